"""The Llama-family decoder (Llama, Mistral, Qwen2, Phi-3; gpt-oss with its sinks and experts): pre-norm layers of
GQA attention with RoPE over the paged KV pool and a SwiGLU MLP, then the final norm and the LM head.

A prompt row that is not sampled matters to later tokens only through the K/V it leaves in each layer, so the last
layer, past its K/V writes, runs only the sampled rows (its output projection and MLP are ~12% of a prompt token's
projection FLOPs in the tiny model's 6 layers).

Under tensor parallelism (`parts.tp`, model/parallel.py) the layers hold one rank's heads and MLP width: the output
and down projections' partial sums are all-reduced, the embedding is looked up in each rank's vocabulary slice and
all-reduced, and rank 0 gathers the LM head's slices of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from overlap.engine.model.layers.attention import PagedAttention
from overlap.engine.model.layers.linear import Linear, LinearBackend
from overlap.engine.model.layers.mlp import GatedMLP
from overlap.engine.model.layers.moe import SparseMoE
from overlap.engine.model.layers.norm import RMSNorm
from overlap.engine.model.layers.rotary import Rotary, StepRotary
from overlap.engine.model.loader import LayerWeights, ModelWeights
from overlap.engine.model.model_spec import ModelSpec
from overlap.engine.model.native import CpuOps

if TYPE_CHECKING:
    from overlap.engine.model.triton_ops import TritonOps
from overlap.engine.model.parallel import Collectives
from overlap.engine.model.step_inputs import StepInputs


@dataclass(slots=True)
class ModelParts:
    """What a model is built from: its shape and weights, the kernels picked for this machine, the KV pool."""

    spec: ModelSpec
    weights: ModelWeights
    linear: LinearBackend
    ops: CpuOps | TritonOps | None  # RMSNorm / RoPE kernels: native (CPU), Triton (GPU), or None for torch ops
    attention: PagedAttention
    rotary: Rotary
    k_pool: list[torch.Tensor]  # per layer, its pool [slots, kv_heads, head_dim]
    v_pool: list[torch.Tensor]
    tp: Collectives | None = None  # this rank's collectives under tensor parallelism; None on one device
    sliding_rotary: Rotary | None = None  # the sliding layers' own RoPE (Gemma 3); None: `rotary` serves every layer
    window_pool: bool = False  # the sliding layers' K/V in a pool of their own (a model that mixes layer types)


class LlamaDecoderLayer:
    def __init__(self, index: int, lw: LayerWeights, parts: ModelParts) -> None:
        spec, linear, ops = parts.spec, parts.linear, parts.ops
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.window = spec.layer_windows[index]
        self.rotary = parts.sliding_rotary if self.window is not None and parts.sliding_rotary else parts.rotary
        self.input_norm = RMSNorm(lw.input_norm, spec.rms_norm_eps, ops, spec.norm_weight_offset, spec.norm_fp32)
        self.qkv = Linear(lw.qkv, lw.qkv_bias, linear)
        self.o = Linear(lw.o, lw.o_bias, linear)
        self.sinks = lw.sinks  # gpt-oss: fp32 [heads], a logit per head in its softmax's denominator (else None)
        self.post_norm = RMSNorm(lw.post_norm, spec.rms_norm_eps, ops, spec.norm_weight_offset, spec.norm_fp32)
        if lw.moe is None:
            self.mlp = GatedMLP(lw.gate_up, lw.gate_up_bias, lw.down, lw.down_bias, linear, ops, spec.hidden_act)
        else:  # a mixture of experts' sparse layer (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss): the same place and reduce
            self.mlp = SparseMoE(lw.moe, spec.moe, linear, ops)
        self.k_pool, self.v_pool = parts.k_pool[index], parts.v_pool[index]
        self.in_window_pool = parts.window_pool and self.window is not None  # its slots and plans: the window pool's

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        """[T, (heads + 2 kv_heads) * head_dim]: q, k and v of every row, before RoPE."""
        return self.qkv(h)

    # Around the two blocks: the MLP's input norm, and what each block's (reduced) output passes through before the
    # residual add: nothing in Llama; Gemma 2/3 norm it (models/gemma.py).
    def before_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(x)

    def after_attention(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def after_mlp(self, out: torch.Tensor) -> torch.Tensor:
        return out


class LlamaModel:
    layer_class = LlamaDecoderLayer

    def __init__(self, parts: ModelParts) -> None:
        self.spec = parts.spec
        self.attention = parts.attention
        w = parts.weights
        self.layers = []
        for i, lw in enumerate(w.layers):
            self.layers.append(self.layer_class(i, lw, parts))
            w.layers[i] = None  # the layer holds what it uses (oneDNN's packed copies on CPU): the rest goes now
        self.rotaries = list(dict.fromkeys(layer.rotary for layer in self.layers))  # each one's rows once a step
        self.embed = w.embed
        self.norm = RMSNorm(w.norm, parts.spec.rms_norm_eps, parts.ops, parts.spec.norm_weight_offset,
                            parts.spec.norm_fp32)  # fmt: skip
        self.head = Linear(w.lm_head, None, parts.linear)
        self.tp = parts.tp
        self.lora = None  # the LoraBatch its projections' adapters read (model/lora.py); None: no adapters

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: the ranks' partial sums added (as it is on one device)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed.index_select(0, input_ids)
        return self.tp.embed(self.embed, input_ids)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return logits if self.tp is None else self.tp.gather_logits(logits, self.spec.vocab_size)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [num sampled seqs, vocab] (model dtype); writes the step's K/V into the pool."""
        steps: dict[Rotary, StepRotary] = {rotary: rotary.at(inputs.positions) for rotary in self.rotaries}
        x = self.embed_tokens(inputs.input_ids)
        lora = inputs.lora if self.lora is not None else None
        if self.lora is not None:
            self.lora.current = None if lora is None else lora.rows
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            plan = inputs.plan_for(layer.window)
            slots = inputs.window_slots if layer.in_window_pool else inputs.slots
            qkv = layer.project_qkv(layer.input_norm(x))
            q = layer.rotary.apply_and_store(qkv, steps[layer.rotary], slots, layer.k_pool, layer.v_pool, layer.heads)
            if index == last and plan.last_layer is not None:
                # Past its K/V, the last layer only feeds the logits: skip the rows nobody samples (every token of a
                # prompt chunk but the last one, and all of a non-final chunk).
                if inputs.sample_rows.numel() == 0:
                    return x.new_empty(0, self.spec.vocab_size)
                q, x = q.index_select(0, inputs.sample_rows), x.index_select(0, inputs.sample_rows)
                if lora is not None:
                    self.lora.current = lora.sampled
                attn = self.attention(q, layer.k_pool, layer.v_pool, *plan.last_layer, layer.window, layer.sinks)
            else:
                attn = self.attention(q, layer.k_pool, layer.v_pool, plan.kernel_plan, plan.seqs, layer.window,
                                      layer.sinks)  # fmt: skip
            # the residual added in place into the block's fresh output
            x = layer.after_attention(self.reduce(layer.o(attn))).add_(x)
            x = layer.after_mlp(self.reduce(layer.mlp(layer.before_mlp(x)))).add_(x)
        if inputs.plan.last_layer is None:  # every row went through; else x holds the sampled rows already
            if inputs.prompt_rows is not None:
                inputs.prompt_logits = self.lm_head(self.norm(x.index_select(0, inputs.prompt_rows)))
            x = x.index_select(0, inputs.sample_rows)
        return self.lm_head(self.norm(x))
