"""The linear method a `QuantizedWeight` runs with, picked on this machine at load.

On CPU (the runner's CPU paths), by what the weight is:
- 4-bit codes in groups of a multiple of 32: the native row kernel (`quant_w4a16.c`, AVX-512 / AVX2 / C as the CPU
  has) for decode-sized steps; with bf16 x on AVX512-BF16 its tiles for steps of 9-128 rows; the weight dequantized
  into oneDNN's matmul for larger ones; without a C compiler, torch's
  int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`), which dequantizes inside the matmul;
- 8-bit codes, symmetric, one scale per row, 16-bit activations: torch's int8 weight-only kernel
  (`_weight_int8pack_mm`);
- W8A8: activations quantized to int8 per token (scale = absmax / 127.5, as compressed-tensors computes it), an
  int8 x int8 -> int32 matmul, then both scales: the native kernel (AVX-512 VNNI / AVX2 / C) on the one copy of the
  weight it packs at load, for every step size; where the CPU has AMX or no VNNI, oneDNN's u8 x s8 matmul for steps
  above 16 rows, on a second copy it prepacks;
- anything else: dequantized at load into a float weight that the float backend runs.

FP8 weights on CPU are dequantized at load (no CPU has FP8 arithmetic; torch's CPU `_scaled_mm` is a slow reference),
which the engine's info says ("... (dequantized at load)").

On the device paths with Triton (CUDA): FP8 with one scale per row through `torch._scaled_mm` where the card has FP8
tensor cores (compute capability 8.9+), the activations quantized to FP8 per token; W4A16, W8A16 and FP8 with group or
block scales (or on older cards) through a Triton kernel that dequantizes inside the matmul (`triton_kernels.py`);
W8A8 INT8 with one scale per row through `torch._int_mm` (cuBLASLt's int8 GEMM) on CUDA, else its per-token
rounding over the dequantized weight (`Int8DynamicReference`).

Each method is checked once against the dequantized reference on a small weight of its kind; a method that errs or
differs is not used (the weight is dequantized instead), as `pick_linear_backend` does for oneDNN.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
import torch.nn.functional as F

from overlap.engine.model import native
from overlap.engine.model.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)

INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4 CPU kernel takes


class QuantMethod:
    """y = x W^T (no bias) for one quantized weight; `name` says which kernel, `nbytes` what a step streams."""

    name = ""
    nbytes = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# Rows up to which W4A16's row kernel beats the weight dequantized into oneDNN's matmul, and, with bf16 x on
# AVX512-BF16, the rows its tiles serve, measured over real shapes' whole steps (`bench/quant_rows.py`,
# docs/engine.md "Prefetching the weight" and "W4A16's tiles").
NATIVE_W4A16_ROWS = 16
W4A16_ROW_KERNEL_ROWS = 8
W4A16_TILES_ROWS = 128
# W8A8 where oneDNN keeps its own copy (`_keeps_onednn`): the rows above which it serves, as before the packed kernel
ONEDNN_W8A8_ABOVE = 16


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] two a byte, input 2i in the low nibble of byte i -> uint8 [N, K / 2]."""
    pairs = codes.view(codes.shape[0], -1, 2)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()


class NativeW4A16(QuantMethod):
    """4-bit weights through quant_w4a16.c, half a byte read a weight. Decode-sized steps: its row kernel. With bf16
    x on AVX512-BF16, steps above `W4A16_ROW_KERNEL_ROWS` up to `W4A16_TILES_ROWS`: its tiles, which make a block of
    codes bf16 in cache for many rows at a time. Larger steps (and the other paths above `NATIVE_W4A16_ROWS`)
    dequantize the weight into a scratch matrix for oneDNN's matmul (compute-bound there)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.kernel = native.quant_linear_kernel()
        k = weight.shape[1]
        # bf16 x through vdpbf16ps (AVX512-BF16): codes read as 128 + code, so the offset takes 128 more zero points
        self.bias = 128.0 if dtype == torch.bfloat16 and self.kernel.bf16_path(k, weight.group_size) else 0.0
        isa = "AVX512-BF16" if self.bias else self.kernel.isa.split()[0]
        self.tiles = bool(self.bias)
        rows = (f"<= {W4A16_ROW_KERNEL_ROWS} rows; tiles <= {W4A16_TILES_ROWS}" if self.tiles
                else f"<= {NATIVE_W4A16_ROWS} rows")  # fmt: skip
        self.name = f"W4A16 native {isa} kernel ({rows}; dequantized above)"
        self.codes = nibbles(weight.codes)
        self.scale = weight.scale.float().contiguous()
        self.offset = (self.scale * (weight.zero.float() + self.bias)).contiguous()
        self.group, self.perm = weight.group_size, weight.perm
        self.nbytes = self.codes.numel() + 4 * (self.scale.numel() + self.offset.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias and x.dtype != torch.bfloat16:  # the offsets hold 128 more zero points, for bf16 x only
            return self(x.to(torch.bfloat16)).to(x.dtype)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        rows = x.shape[0]
        if self.tiles and x.dtype == torch.bfloat16 and W4A16_ROW_KERNEL_ROWS < rows <= W4A16_TILES_ROWS:
            out = self.kernel.w4a16_tiles(x, self.codes, self.scale, self.offset, self.group)
            if out is not None:
                return out
        if rows <= (W4A16_ROW_KERNEL_ROWS if self.tiles else NATIVE_W4A16_ROWS):
            return self.kernel.w4a16(x, self.codes, self.scale, self.offset, self.group).to(x.dtype)
        scratch = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        weight = self.kernel.w4a16_dequantize(self.codes, self.scale, self.offset, self.bias, self.group, scratch)
        return F.linear(x.to(scratch), weight).to(x.dtype)


class NativeW8A8(QuantMethod):
    """W8A8 through quant_w8a8.c: x quantized per token as compressed-tensors does, int8 x int8 sums in int32 (VNNI's
    vpdpbusd, else widened multiply-adds), both scales applied in the same pass, for any number of rows, on the one
    copy of the weight packed at load. Where oneDNN's u8 x s8 matmul is faster for larger steps (`_keeps_onednn`: a
    CPU with AMX-INT8, or one without VNNI, whose kernel widens to int16), it serves the steps above
    `ONEDNN_W8A8_ABOVE` rows from a second copy it prepacks, counted in `nbytes`; x's scale goes in per row after the
    call (which takes one scale for all of x), so the numbers are the per-token ones there too."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.kernel = native.quant_linear_kernel()
        signed = signed_int8(weight.codes)
        self.rowsum = signed.sum(dim=1, dtype=torch.int32)
        self.scale = weight.scale[:, 0].float().contiguous()
        self.packed = self.kernel.w8a8_pack(signed)
        self.onednn = onednn_int8(signed) if _keeps_onednn(self.kernel) else None
        self.rows_max = ONEDNN_W8A8_ABOVE if self.onednn is not None else None
        above = f" (<= {ONEDNN_W8A8_ABOVE} rows; oneDNN u8s8 matmul above)" if self.onednn is not None else ""
        self.name = f"W8A8 native {self.kernel.isa} kernel{above}"
        self.nbytes = self.packed.numel() * (2 if self.onednn is not None else 1) + 8 * self.scale.numel()
        self.zero_points = torch.zeros(self.scale.shape[0], dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        if self.rows_max is None or x.shape[0] <= self.rows_max:
            return self.kernel.w8a8(x, self.packed, self.rowsum, self.scale, out_dtype).to(x.dtype)
        return self.onednn_matmul(x, out_dtype).to(x.dtype)

    def onednn_matmul(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x through oneDNN's u8 x s8 matmul on `self.onednn` (`onednn_int8` of this weight): x quantized per token
        by quant_w8a8.c, then its scales applied per row to the fp32 sums, rounded once to `out_dtype`."""
        codes, x_scale = self.kernel.w8a8_quantize(x)
        sums = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 128, self.onednn, self.scale, self.zero_points,
                                                  None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip
        return self.kernel.w8a8_scale_rows(sums, x_scale, out_dtype)


class ScaledMmFp8(QuantMethod):
    """FP8 weights with one scale per row through `torch._scaled_mm` (FP8 tensor cores): x quantized to FP8 per token
    (scale = absmax / 448, dynamic, as compressed-tensors' FP8_DYNAMIC scheme and vLLM compute it), the weight's
    bytes used as they are, both scales applied to the fp32 sums."""

    name = "FP8 torch._scaled_mm (per-token FP8 activations)"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight_t = weight.codes.view(torch.float8_e4m3fn).t()  # [K, N], column-major as _scaled_mm wants
        self.scale = weight.scale[:, 0].float().reshape(1, -1).contiguous()
        self.nbytes = weight.codes.numel() + 4 * self.scale.numel()

    @staticmethod
    def supports(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
        n, k = weight.shape
        on_fp8_card = weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) >= (8, 9)
        return on_fp8_card and weight.float8 and weight.per_row and dtype == torch.bfloat16 and n % 16 == k % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_fp8, x_scale = quantize_fp8_per_token(x)
        return torch._scaled_mm(x_fp8, self.weight_t, scale_a=x_scale, scale_b=self.scale, out_dtype=x.dtype)


FP8_MAX = 448.0  # the largest float8_e4m3fn


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as float8_e4m3fn and an fp32 scale per row [M, 1]."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _keeps_onednn(kernel) -> bool:
    """Whether oneDNN's u8 x s8 matmul serves W8A8's larger steps here: with AMX-INT8 (its tiles), or where the kernel
    has no VNNI (AVX2 or C: at 64-256 rows it took 1.6-2.2x oneDNN's time, limited to AVX2, on the 0.5B shape)."""
    return native.cpu_isa().startswith("AMX") or kernel.isa != "AVX-512 VNNI"


def signed_int8(codes: torch.Tensor) -> torch.Tensor:
    """8-bit codes stored as uint8 (code + 128, as `QuantizedWeight` holds a symmetric int8 weight) as the int8
    code itself: the sign bit flipped, the same bytes read as int8."""
    return (codes.contiguous() ^ 128).view(torch.int8)


def onednn_int8(weight: torch.Tensor):
    """The int8 weight prepacked for oneDNN's u8 x s8 matmul, or None where this torch build lacks it."""
    try:
        return torch.ops.onednn.qlinear_prepack(weight, None)
    except (AttributeError, RuntimeError):
        return None


class Int4WeightOnly(QuantMethod):
    name = "int4 weight-only (torch int4pack)"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.group = weight.group_size
        self.perm = weight.perm
        self.packed = torch._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32).contiguous(), 2)
        # The kernel computes (code - 8) * scale + offset: offset = (8 - zero) * scale gives (code - zero) * scale.
        offset = (8 - weight.zero) * weight.scale
        self.scales_offsets = torch.stack([weight.scale.t(), offset.t()], dim=-1).to(dtype).contiguous()
        self.nbytes = self.packed.numel() + self.scales_offsets.numel() * self.scales_offsets.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group, self.scales_offsets)


class Int8WeightOnly(QuantMethod):
    name = "int8 weight-only (torch int8pack)"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = signed_int8(weight.codes)
        self.scale = weight.scale[:, 0].to(dtype).contiguous()
        self.perm = weight.perm
        self.nbytes = self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.contiguous(), self.weight, self.scale)


class Int8Dynamic(QuantMethod):
    """W8A8: int8 activations per token (dynamic), int8 weights per row, int32 sums (`torch._int_mm`: cuBLASLt's
    int8 GEMM on CUDA, which takes more than 16 rows: fewer are padded with zero rows)."""

    name = "W8A8 int8 (dynamic per-token activations, torch _int_mm)"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.min_rows = 17 if weight.device.type == "cuda" else 1
        self.weight_t = signed_int8(weight.codes).t().contiguous()  # [K, N]
        self.scale = weight.scale[:, 0].float().contiguous()
        self.nbytes = self.weight_t.numel() + 4 * self.scale.numel()

    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        """On CUDA: cuBLASLt's int8 GEMM wants inputs and outputs in multiples of 8."""
        n, k = weight.shape
        return weight.act_bits == 8 and weight.bits == 8 and weight.per_row and weight.symmetric and (
            n % 8 == 0 and k % 8 == 0)  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = quantize_per_token(x)
        rows = x_q.shape[0]
        if rows < self.min_rows:
            x_q = torch.cat([x_q, x_q.new_zeros(self.min_rows - rows, x_q.shape[1])])
        sums = torch._int_mm(x_q, self.weight_t)[:rows]
        return (sums * x_scale * self.scale).to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as int8 codes and a scale per row, symmetric: scale = absmax / 127.5 in x's dtype, as compressed-tensors
    computes dynamic per-token scales."""
    scale = (x.abs().amax(dim=1, keepdim=True) / 127.5).clamp_min(torch.finfo(x.dtype).tiny)
    codes = torch.round(x / scale).clamp_(-128, 127).to(torch.int8)
    return codes, scale.float()


class Int8DynamicReference(QuantMethod):
    """W8A8 where no int8 matmul runs (device-generic paths): the same per-token rounding of x, then a float matmul
    on the dequantized weight, so the numbers are the ones the checkpoint was calibrated for."""

    name = "W8A8 (per-token int8 activations, dequantized weights)"

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        self.weight = weight.dequantize(dtype)
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_per_token(x)
        return torch.nn.functional.linear((codes.float() * scale).to(x.dtype), self.weight)


def _candidates(weight: QuantizedWeight) -> list[type[QuantMethod]]:
    n, k = weight.shape
    native_kernel = native.quant_linear_kernel() is not None
    if weight.float8:
        return []
    if weight.act_bits == 8:
        if weight.bits == 8 and weight.per_row and weight.symmetric:
            native_w8a8 = native_kernel and k <= native.QuantLinearKernel.MAX_K
            return [*([NativeW8A8] if native_w8a8 else []), Int8Dynamic, Int8DynamicReference]
        return [Int8DynamicReference]
    if weight.bits == 4 and weight.group_size % 32 == 0 and k % weight.group_size == 0 and native_kernel:
        return [NativeW4A16]
    if weight.bits == 4 and weight.group_size in INT4_GROUPS and k % weight.group_size == 0 and n % 16 == 0:
        return [Int4WeightOnly]
    if weight.bits == 8 and weight.per_row and weight.symmetric and weight.perm is None:
        return [Int8WeightOnly]
    return []


@functools.cache
def _works(method: type[QuantMethod], bits: int, group: int | None, act_bits: int | None, symmetric: bool,
           dtype: torch.dtype) -> bool:  # fmt: skip
    """Whether `method` runs here and computes what the dequantized weight does, on a small weight of this kind."""
    gen = torch.Generator().manual_seed(0)
    n, k = 48, math.lcm(256, group or 256)  # whole groups, however large
    group = group or k
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    zero = torch.full_like(scale, 2.0 ** (bits - 1)) if symmetric else torch.randint(0, 2**bits, scale.shape).float()
    weight = QuantizedWeight(codes, scale, zero, bits, group, "check", act_bits=act_bits)
    try:
        with torch.inference_mode():
            x = torch.randn(5, k, generator=gen).to(dtype)
            got = method(weight, dtype)(x).float()
            x_big = torch.randn(40, k, generator=gen).to(dtype)  # past the native kernels' rows
            got_big = method(weight, dtype)(x_big).float()
            reference = Int8DynamicReference(weight, torch.float32) if act_bits == 8 else None
            want, want_big = (reference(v.float()) if reference else v.float() @ weight.dequantize(torch.float32).t()
                              for v in (x, x_big))  # fmt: skip
    except (RuntimeError, AttributeError, NotImplementedError, ValueError) as exc:
        log.info("%s not used: %s", method.__name__, exc)
        return False
    tolerance = 1e-3 if dtype == torch.float32 else 3e-2
    ok = all(torch.allclose(a, b, atol=tolerance * float(b.abs().max()), rtol=tolerance)
             for a, b in ((got, want), (got_big, want_big)))  # fmt: skip
    if not ok:
        log.info("%s not used: its result differs from the dequantized weight's", method.__name__)
    return ok


def quantized_method(weight: QuantizedWeight, dtype: torch.dtype, cpu_paths: bool,
                     triton: bool = False) -> QuantMethod | None:  # fmt: skip
    """The kernel for `weight` on this machine, or None: dequantize it at load and run the float backend. `triton`:
    the runner's device paths run Triton (CUDA, or its interpreter). OVERLAP_QUANTIZED_KERNELS=0 dequantizes every
    weight at load (the reference the kernels are compared with)."""
    if os.environ.get("OVERLAP_QUANTIZED_KERNELS", "1") == "0":
        return Int8DynamicReference(weight, dtype) if weight.act_bits == 8 else None
    if triton and not cpu_paths:
        from overlap.engine.model.quant.triton_kernels import TritonWeightOnly

        if ScaledMmFp8.supports(weight, dtype):
            return ScaledMmFp8(weight, dtype)
        if weight.device.type == "cuda" and Int8Dynamic.supports(weight):
            return Int8Dynamic(weight, dtype)
        if TritonWeightOnly.supports(weight):
            return TritonWeightOnly(weight, dtype)
    if cpu_paths and weight.device.type == "cpu":
        for method in _candidates(weight):
            group = None if weight.per_row else weight.group_size
            if method is Int8DynamicReference or _works(method, weight.bits, group, weight.act_bits,
                                                        weight.symmetric, dtype):  # fmt: skip
                return method(weight, dtype)
    if weight.act_bits == 8:  # the activations' rounding is part of the model: kept on every path
        return Int8DynamicReference(weight, dtype)
    return None
