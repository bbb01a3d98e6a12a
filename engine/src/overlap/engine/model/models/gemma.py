"""Gemma 1, 2 and 3 (text): the Llama decoder with Gemma's differences, computed as transformers 5 computes them.

Every Gemma (the spec's fields, set by the loader, reach the shared layers):
- RMSNorm scales by (1 + weight), in fp32 whatever the model's dtype (`norm_weight_offset`, layers/norm.py);
- the MLP is GeGLU, gelu with the tanh approximation (`hidden_act`, layers/mlp.py);
- the embeddings are multiplied by sqrt(hidden_size), a factor rounded to the model's dtype first (here).

Gemma 2 and 3 add (here, and through the spec):
- "sandwich" norms: each block's output is normed before its residual add, and the MLP's input by its own norm;
- scores scaled by query_pre_attn_scalar ** -0.5, and Gemma 2's attention logits soft-capped (layers/attention.py);
- the final logits soft-capped: cap * tanh(logits / cap);
- sliding and full layers interleaved (`layer_windows`); Gemma 3's sliding layers have a RoPE base of their own
  (`ModelParts.sliding_rotary`) and every layer norms each head's q and k, with (1 + weight) too.
"""

from __future__ import annotations

import torch

from overlap.engine.model.layers.norm import HeadNorm, RMSNorm
from overlap.engine.model.loader import LayerWeights
from overlap.engine.model.models.llama import LlamaDecoderLayer, LlamaModel, ModelParts


class GemmaModel(LlamaModel):
    """Gemma 1, and what Gemma 2 and 3 share with it: the scaled embeddings and the final soft-capping."""

    def __init__(self, parts: ModelParts) -> None:
        super().__init__(parts)
        # transformers keeps sqrt(hidden) as an fp32 tensor and casts it to the weights' dtype at each lookup
        # (sqrt(1152) = 33.94 becomes 34.0 in bf16)
        self.embed_scale = torch.tensor(parts.spec.hidden_size**0.5, dtype=torch.float32).to(self.embed.dtype)
        self.embed_scale = self.embed_scale.to(self.embed.device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids).mul_(self.embed_scale)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().lm_head(x)
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Gemma 2 and 3: post_attention_layernorm norms the attention's output; pre_ and post_feedforward_layernorm
    the MLP's input and output. Gemma 3 norms each head's q and k before RoPE."""

    def __init__(self, index: int, lw: LayerWeights, parts: ModelParts) -> None:
        super().__init__(index, lw, parts)
        spec, offset = parts.spec, parts.spec.norm_weight_offset
        self.pre_mlp_norm = RMSNorm(lw.pre_mlp_norm, spec.rms_norm_eps, parts.ops, offset)
        self.post_mlp_norm = RMSNorm(lw.post_mlp_norm, spec.rms_norm_eps, parts.ops, offset)
        self.head_norm = None
        if spec.qk_norm:
            self.head_norm = HeadNorm(lw.q_norm, lw.k_norm, spec.rms_norm_eps, self.heads, self.kv_heads, offset)

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(h)
        return qkv if self.head_norm is None else self.head_norm(qkv)

    def before_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_mlp_norm(x)

    def after_attention(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_norm(out)

    def after_mlp(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_norm(out)


class Gemma2Model(GemmaModel):
    """Gemma 2 and Gemma 3 (text)."""

    layer_class = Gemma2DecoderLayer
