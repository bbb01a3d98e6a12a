"""Qwen3: the Llama decoder with an RMSNorm over each head's q and k, before RoPE."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overlap.engine.model.loader import LayerWeights
from overlap.engine.model.models.llama import LlamaDecoderLayer, LlamaModel, ModelParts


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, index: int, lw: LayerWeights, parts: ModelParts) -> None:
        super().__init__(index, lw, parts)
        self.q_norm, self.k_norm, self.eps = lw.q_norm, lw.k_norm, parts.spec.rms_norm_eps

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(h)
        num_tokens, q_size = qkv.shape[0], self.heads * self.head_dim
        q_heads = qkv[:, :q_size].view(num_tokens, self.heads, self.head_dim)
        k_heads = qkv[:, q_size : q_size + self.kv_heads * self.head_dim].view(num_tokens, self.kv_heads, self.head_dim)
        q_heads.copy_(F.rms_norm(q_heads, (self.head_dim,), self.q_norm, self.eps))  # in place in qkv
        k_heads.copy_(F.rms_norm(k_heads, (self.head_dim,), self.k_norm, self.eps))
        return qkv


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer
