"""RMSNorm: one native call on CPU (fp32, bf16; torch takes ~8 kernels and two fp32 round trips), one Triton kernel
next to the Triton attention (`triton_ops.py`), F.rms_norm elsewhere.

Gemma's norms scale by (1 + weight) and compute in fp32 whatever the model's dtype, rounding once at the end
(`offset`): their weight is kept as 1 + w in fp32, and every kernel here takes an fp32 weight beside bf16 rows.
gpt-oss's multiply by the weight in fp32 too (`fp32`): transformers' GptOssRMSNorm rounds once, after the weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from overlap.engine.model.native import CpuOps

if TYPE_CHECKING:
    from overlap.engine.model.triton_ops import TritonOps


def offset_weight(weight: torch.Tensor, offset: float, fp32: bool = False) -> torch.Tensor:
    """The weight a norm multiplies by: `weight` itself, or offset + weight in fp32 (Gemma: 1 + w, as transformers
    adds it in fp32 on every call; gpt-oss: w in fp32)."""
    return weight if not (offset or fp32) else offset + weight.float()


class RMSNorm:
    __slots__ = ("eps", "ops", "shape", "weight")

    def __init__(self, weight: torch.Tensor, eps: float, ops: CpuOps | TritonOps | None, offset: float = 0.0,
                 fp32: bool = False) -> None:  # fmt: skip
        self.weight = offset_weight(weight, offset, fp32)
        self.eps = eps
        self.shape = (weight.shape[0],)
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if self.weight.dtype != x.dtype:  # an fp32 weight: the norm in fp32, rounded once
            return F.rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class HeadNorm:
    """RMSNorm over each head's q and k in a qkv row [T, (heads + 2 kv_heads) * head_dim], in place, before RoPE
    (Gemma 3; Qwen3's is in models/qwen3.py). Computed in the weights' dtype and rounded once into qkv."""

    __slots__ = ("eps", "heads", "k_weight", "kv_heads", "q_weight", "shape")

    def __init__(self, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 offset: float = 0.0) -> None:  # fmt: skip
        self.q_weight, self.k_weight = offset_weight(q_weight, offset), offset_weight(k_weight, offset)
        self.eps, self.heads, self.kv_heads = eps, heads, kv_heads
        self.shape = (q_weight.shape[0],)

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        num_tokens, head_dim = qkv.shape[0], self.shape[0]
        q_size = self.heads * head_dim
        q = qkv[:, :q_size].view(num_tokens, self.heads, head_dim)
        k = qkv[:, q_size : q_size + self.kv_heads * head_dim].view(num_tokens, self.kv_heads, head_dim)
        for heads, weight in ((q, self.q_weight), (k, self.k_weight)):
            heads.copy_(F.rms_norm(heads.to(weight.dtype), self.shape, weight, self.eps))
        return qkv
