"""Quantized projections on the GPU path, as Triton kernels that dequantize inside the matmul: W4A16, W8A16 and FP8
codes are read packed (8 or 4 a 32-bit word along the inputs) with their group's scale and zero point, widened to the
activations' dtype in registers, and fed to `tl.dot`; nothing dequantized ever goes back to memory. One kernel serves
decode (a few rows: the weight's bytes bound it) and prefill (many rows: the dot). FP8 codes are decoded by their
bits (sign, 4-bit exponent, 3-bit mantissa), which any GPU and the interpreter compute alike; a 128x128 block's scale
arrives repeated per row (`QuantizedWeight`), read once per row and group like an integer group's.

Tests run it on the CPU in Triton's interpreter against the dequantized weight (tests/engine/test_quantized.py); the
GPU check (bench/gpu/check.sh, case `quantized`) runs it at the 8B shape against its streaming floor.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from overlap.engine.model.quant.weight import QuantizedWeight

# Triton's interpreter (tests on the CPU) computes a bf16 tl.dot wrongly (values of 1e11 against a bf16 reference of
# 1): there the dot takes fp32 operands, the same numbers widened.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _wint_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, rows, n, k, x_stride, groups,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """out[rows, n] = x[rows, k] @ W^T, W[n, kk] = (code - zero[n, kk // GROUP]) * scale[n, kk // GROUP], the codes
    of row n packed 32 // BITS a word, the first in the low bits; with FP8, code is the float8_e4m3fn value of the
    byte. BLOCK_K divides GROUP."""
    per_word: tl.constexpr = 32 // BITS
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * x_stride + kk[None, :], mask=(m[:, None] < rows) & (kk[None, :] < k),
                    other=0.0)  # fmt: skip
        words = tl.load(w_ptr + cols[:, None] * (k // per_word) + kk[None, :] // per_word,
                        mask=cols[:, None] < n, other=0)  # fmt: skip
        codes = (words >> ((kk[None, :] % per_word) * BITS)) & ((1 << BITS) - 1)
        group = k0 // GROUP
        scale = tl.load(scale_ptr + cols * groups + group, mask=cols < n, other=0.0)
        zero = tl.load(zero_ptr + cols * groups + group, mask=cols < n, other=0.0)
        if FP8:  # e4m3: 1.mmm * 2**(e - 7), or 0.mmm * 2**-6 where e = 0
            exponent, mantissa = (codes >> 3) & 15, (codes & 7).to(tl.float32)
            magnitude = tl.where(exponent == 0, mantissa * 0.001953125,
                                 (mantissa + 8.0) * tl.exp2(exponent.to(tl.float32) - 10.0))  # fmt: skip
            values = tl.where((codes >> 7) != 0, -magnitude, magnitude)
        else:
            values = codes.to(tl.float32)
        w = (values - zero[:, None]) * scale[:, None]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(out_ptr + m[:, None] * n + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < rows) & (cols[None, :] < n))  # fmt: skip


class TritonWeightOnly:
    """W4A16 / W8A16 / FP8 weights with 16-bit activations on the GPU path (`quantized_method` picks it where Triton
    runs): the codes packed into int32 words at load, a scale and a zero point per group in fp32."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        n, k = weight.shape
        per_word = 32 // weight.bits
        codes = weight.codes.to(torch.int64).view(n, k // per_word, per_word)
        words = sum(codes[:, :, i] << (weight.bits * i) for i in range(per_word))
        self.words = (words - ((words >> 31) << 32)).to(torch.int32).contiguous()
        self.scale, self.zero = weight.scale.float().contiguous(), weight.zero.float().contiguous()
        self.bits, self.group, self.perm, self.n, self.k = weight.bits, weight.group_size, weight.perm, n, k
        self.block_k = next(b for b in (64, 32, 16) if self.group % b == 0)
        self.float8 = weight.float8
        kind = "FP8 (16-bit activations)" if self.float8 else f"W{weight.bits}A16"
        self.name = f"{kind} Triton kernel (dequantized inside the matmul)"
        self.nbytes = self.words.numel() * 4 + 4 * (self.scale.numel() + self.zero.numel())

    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        return weight.act_bits is None and weight.bits in (4, 8) and weight.group_size % 16 == 0 and (
            weight.shape[1] % weight.group_size == 0)  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.n, dtype=x.dtype, device=x.device)
        block_m = 16 if rows <= 16 else 64
        grid = (triton.cdiv(rows, block_m), triton.cdiv(self.n, 64))
        _wint_kernel[grid](x, self.words, self.scale, self.zero, out, rows, self.n, self.k, x.stride(0),
                           self.k // self.group, BITS=self.bits, GROUP=self.group, BLOCK_M=block_m, BLOCK_N=64,
                           BLOCK_K=self.block_k, DOT_FP32=x.dtype == torch.float32 or INTERPRETED,
                           FP8=self.float8)  # fmt: skip
        return out
