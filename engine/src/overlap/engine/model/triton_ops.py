"""The small per-layer ops of a decode step as one Triton kernel each, on the GPU path: RMSNorm, RoPE with the K/V
write, and the gated MLP's SiLU(gate) * up.

Why: on an H200 an ~8B decode step at batch 1 spent about a fifth of its kernel time outside the matmuls and the
attention, in torch's generic kernels (a one-row RMSNorm ran ~6 us; RoPE was a cat, two elementwise kernels and two
index copies per layer, plus two table gathers per step). One launch each reads and writes every byte once.

`TritonOps` has the interface of `native.CpuOps` (the runner passes either as `ops` to the layers), plus `silu_mul`.
Tests run these kernels on the CPU in Triton's interpreter against the torch ops (tests/engine/test_triton_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, rows, hidden, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS rows per program (one on a GPU: a row is enough work; more in the interpreter, which pays per program)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < hidden)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_kv_kernel(qkv_ptr, qkv_stride, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          QK_P2: tl.constexpr, KV_P2: tl.constexpr, HEAD_P2: tl.constexpr):  # fmt: skip
    """One program per token: rotate-half RoPE on its q and k heads (a [heads, head_dim] tile); q in place in qkv,
    k and v into the token's slot of the pools [slots, KV_HEADS, HEAD_DIM]."""
    token = tl.program_id(0)
    row = qkv_ptr + token * qkv_stride
    cols = tl.arange(0, HEAD_P2)[None, :]
    head = tl.arange(0, QK_P2)[:, None]
    mask = (head < HEADS + KV_HEADS) & (cols < HEAD_DIM)
    x = tl.load(row + head * HEAD_DIM + cols, mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(row + head * HEAD_DIM + (cols + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + token)
    cos = tl.load(cos_ptr + pos * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HEAD_DIM + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
    rotated = (x * cos + swapped * sin).to(qkv_ptr.dtype.element_ty)
    tl.store(row + head * HEAD_DIM + cols, rotated, mask=mask & (head < HEADS))
    slot_row = tl.load(slot_ptr + token) * (KV_HEADS * HEAD_DIM)
    tl.store(k_ptr + slot_row + (head - HEADS) * HEAD_DIM + cols, rotated, mask=mask & (head >= HEADS))
    kv_head = tl.arange(0, KV_P2)[:, None]
    kv_mask = (kv_head < KV_HEADS) & (cols < HEAD_DIM)
    v = tl.load(row + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + cols, mask=kv_mask)
    tl.store(v_ptr + slot_row + kv_head * HEAD_DIM + cols, v, mask=kv_mask)


@triton.jit
def _silu_mul_kernel(x_ptr, x_stride, out_ptr, rows, inter, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < inter)
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(x: torch.Tensor, rows: int) -> int:
    """One row per program on a GPU; up to 16 in Triton's interpreter on a CPU, which pays per program."""
    return 1 if x.is_cuda else min(16, triton.next_power_of_2(rows))


class TritonOps:
    """RMSNorm, RoPE with the K/V write, SiLU-mul: one launch per call, over every row of the step."""

    name = "Triton RMSNorm, RoPE + K/V write, SiLU-mul"

    @staticmethod
    def argmax(x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """torch's rms_norm over the last dim of x [rows, hidden] (rows may be strided), one rounding: a new tensor."""
        rows, hidden = x.shape
        if x.stride(1) != 1 or not weight.is_contiguous() or weight.shape != (hidden,):
            raise ValueError("rms_norm: x rows with a contiguous last dim and a weight of that size")
        out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
        if rows:
            block, per = triton.next_power_of_2(hidden), _rows_per_program(x, rows)
            warps = min(16, max(1, block // 256))
            _rms_norm_kernel[(triton.cdiv(rows, per),)](x, x.stride(0), weight, out, rows, hidden, eps, ROWS=per,
                                                        BLOCK=block, num_warps=warps)  # fmt: skip
        return out

    @staticmethod
    def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                      slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int) -> None:  # fmt: skip
        """RoPE on the q heads of qkv [tokens, (heads + 2 kv_heads) * head_dim] in place, each token's rotated K and
        its V into its slot of the pools [slots, kv_heads, head_dim]. cos/sin_signed [positions, head_dim] (sin's
        first half negated: rotate-half form); positions and slots int64 [tokens]."""
        tokens = qkv.shape[0]
        kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
        if qkv.stride(1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim:
            raise ValueError("rope: qkv rows of (heads + 2 kv_heads) * head_dim, contiguous")
        if head_dim % 2 or not all(t.is_contiguous() for t in (cos, sin_signed, k_pool, v_pool)):
            raise ValueError("rope: an even head_dim, contiguous tables and pools")
        if tokens:
            p2 = triton.next_power_of_2
            _rope_store_kv_kernel[(tokens,)](
                qkv, qkv.stride(0), positions, cos, sin_signed, slots, k_pool, v_pool,
                HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                QK_P2=p2(heads + kv_heads), KV_P2=p2(kv_heads), HEAD_P2=p2(head_dim), num_warps=4,
            )  # fmt: skip

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate_up[:, :I]) * gate_up[:, I:] for gate_up [rows, 2 I], one rounding."""
        rows, width = gate_up.shape
        inter = width // 2
        if gate_up.stride(1) != 1 or width % 2:
            raise ValueError("silu_mul: rows of [gate | up], contiguous")
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            block, per = 1024, _rows_per_program(gate_up, rows)
            grid = (triton.cdiv(rows, per), triton.cdiv(inter, block))
            _silu_mul_kernel[grid](gate_up, gate_up.stride(0), out, rows, inter, ROWS=per, BLOCK=block, num_warps=4)
        return out
