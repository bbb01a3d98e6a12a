"""Rotary position embeddings (RoPE) applied to a step's q and k, with the step's K and V written into the pool.

The tables are transformers' own (`model_spec.rope_tables`), in rotate-half form with the sign of sin's first half
folded in. Partial rotary (only the first rotary_dim dims of a head rotate, in pairs (i, i + rotary_dim/2)) runs as
full-width rotate-half: the q/k dims of every head are reordered once at load so the rotated pairs come first in
each half and the passed-through ones after them, with angle 0 (`partial_rotary_layout`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from overlap.engine.errors import ModelLoadError
from overlap.engine.model.loader import ModelWeights
from overlap.engine.model.model_spec import ModelSpec
from overlap.engine.model.native import CpuOps

if TYPE_CHECKING:
    from overlap.engine.model.triton_ops import TritonOps


class StepRotary:
    """The tables' rows at a step's positions (torch path: gathered once per step, shared by every layer)."""

    __slots__ = ("cos", "positions", "sin")

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        self.positions = positions
        self.cos = cos
        self.sin = sin


class Rotary:
    __slots__ = ("cos", "head_dim", "ops", "sin_signed")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, ops: CpuOps | TritonOps | None) -> None:
        """cos, sin [positions, head_dim] on the device in the model's dtype (rotate-half layout)."""
        half = cos.shape[1] // 2
        self.cos = cos
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.head_dim = cos.shape[1]
        self.ops = ops

    def at(self, positions: torch.Tensor) -> StepRotary:
        if self.ops is not None:
            return StepRotary(positions, None, None)
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.sin_signed.index_select(0, positions).unsqueeze(1)
        return StepRotary(positions, cos, sin)

    def apply_and_store(self, qkv: torch.Tensor, step: StepRotary, slots: torch.Tensor, k_pool: torch.Tensor,
                        v_pool: torch.Tensor, heads: int) -> torch.Tensor:  # fmt: skip
        """RoPE on the q and k heads of qkv [T, (heads + 2 kv_heads) * D], K and V into their slots of the layer's
        pools [slots, kv_heads, D]; returns q [T, heads, D]."""
        num_tokens, head_dim = qkv.shape[0], self.head_dim
        kv_heads = k_pool.shape[1]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        if self.ops is not None:
            self.ops.rope_store_kv(qkv, step.positions, self.cos, self.sin_signed, slots, k_pool, v_pool, heads)
            return qkv[:, :q_size].view(num_tokens, heads, head_dim)
        # x * cos + rotate_half(x) * sin, rotate_half as the two halves swapped with the sign folded into sin (three
        # elementwise kernels, not ten). The swap is a cat, not flip(): CPU flip is a slow generic kernel.
        qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, 2, head_dim // 2)
        swapped = torch.cat([qk[:, :, 1:], qk[:, :, :1]], dim=2).view(num_tokens, -1, head_dim)
        qk = torch.addcmul(qk.view(num_tokens, -1, head_dim) * step.cos, swapped, step.sin)
        k_pool.index_copy_(0, slots, qk[:, heads:])
        v_pool.index_copy_(0, slots, qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim))
        return qk[:, :heads]


def partial_rotary_layout(spec: ModelSpec, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor):
    """(weights, cos, sin) for full-width rotate-half: unchanged when every dim rotates; else every q and k head's
    dims reordered (projection rows, biases, q/k norms) and the tables padded with angle 0 where dims pass through.
    Scores are unchanged (q and k get the same order; q.k sums over all dims); the pool holds K in this order."""
    rotary_dim = cos.shape[1]
    if rotary_dim == spec.head_dim:
        return weights, cos, sin
    if (spec.head_dim - rotary_dim) % 2:
        raise ModelLoadError(f"partial rotary over {rotary_dim} of {spec.head_dim} head dims: an odd remainder")
    h, p = rotary_dim // 2, (spec.head_dim - rotary_dim) // 2
    order = torch.cat([torch.arange(h), torch.arange(rotary_dim, rotary_dim + p), torch.arange(h, rotary_dim),
                       torch.arange(rotary_dim + p, spec.head_dim)])  # fmt: skip
    ones, zeros = cos.new_ones(cos.shape[0], p), cos.new_zeros(cos.shape[0], p)
    cos = torch.cat([cos[:, :h], ones, cos[:, h:], ones], 1)
    sin = torch.cat([sin[:, :h], zeros, sin[:, h:], zeros], 1)
    qk_heads = spec.num_heads + spec.num_kv_heads
    rows = (torch.arange(qk_heads).unsqueeze(1) * spec.head_dim + order).flatten()
    rows = torch.cat([rows, torch.arange(qk_heads * spec.head_dim, weights.layers[0].qkv.shape[0])])  # v as is
    layers = []
    for lw in weights.layers:
        rows_here, order_here = rows.to(lw.qkv.device), order.to(lw.qkv.device)
        layers.append(
            dataclasses.replace(
                lw,
                qkv=lw.qkv.index_select(0, rows_here),
                qkv_bias=None if lw.qkv_bias is None else lw.qkv_bias.index_select(0, rows_here),
                q_norm=None if lw.q_norm is None else lw.q_norm.index_select(0, order_here),
                k_norm=None if lw.k_norm is None else lw.k_norm.index_select(0, order_here),
            )
        )
    return dataclasses.replace(weights, layers=layers), cos, sin
