"""LoRA on the GPU path: each row's adapter delta in two Triton launches (BGMV, as punica and vLLM's lora ops do).

shrink: s[t] = A[slot[t]] x[t]  ([rows, R], R = segments * max_rank, fp32 accumulation)
expand: y[t] += B[slot[t]] s[t]  (in y's dtype), in place

One program per row (shrink) or per row and block of outputs (expand); a row with slot -1 (the base model) does
nothing. The batch mixes adapters freely: no sorting or grouping of rows. Tests run both kernels on the CPU in
Triton's interpreter against the gathered torch matmuls (tests/engine/test_lora.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, x_stride, a_ptr, slot_ptr, s_ptr, K, R: tl.constexpr, R_P2: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    r = tl.arange(0, R_P2)[:, None]
    acc = tl.zeros((R_P2,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        k = start + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + row * x_stride + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * R * K + r * K + k, mask=(r < R) & (k < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x, axis=1)
    cols = tl.arange(0, R_P2)
    tl.store(s_ptr + row * R + cols, acc, mask=cols < R)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slot_ptr, y_ptr, y_stride, N, R: tl.constexpr, R_P2: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[:, None]
    r = tl.arange(0, R_P2)[None, :]
    s = tl.load(s_ptr + row * R + r, mask=r < R, other=0.0)
    b = tl.load(b_ptr + slot * N * R + n * R + r, mask=(n < N) & (r < R), other=0.0).to(tl.float32)
    out = tl.sum(b * s, axis=1)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + row * y_stride + cols, mask=cols < N, other=0.0)
    tl.store(y_ptr + row * y_stride + cols, (y.to(tl.float32) + out).to(y.dtype), mask=cols < N)


def lora_bgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += B[slots] (A[slots] x) per row, in place; a [slots, R, K], b [slots, N, R], slots int [T] (-1:
    none). x and y rows may be strided (slices of a fused output); their columns contiguous."""
    rows, k = x.shape
    n, r = b.shape[1], b.shape[2]
    if rows == 0:
        return y
    if x.stride(1) != 1 or y.stride(1) != 1 or a.shape[1:] != (r, k) or y.shape != (rows, n):
        raise ValueError(f"lora_bgmv: x {list(x.shape)}, y {list(y.shape)}, A {list(a.shape)}, B {list(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    shrunk = torch.zeros(rows, r, dtype=torch.float32, device=x.device)
    r_p2 = triton.next_power_of_2(r)
    _shrink_kernel[(rows,)](x, x.stride(0), a, slots, shrunk, k, r, r_p2, BLOCK_K)
    _expand_kernel[(rows, triton.cdiv(n, BLOCK_N))](shrunk, b, slots, y, y.stride(0), n, r, r_p2, BLOCK_N)
    return y
