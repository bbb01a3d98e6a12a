"""One layout for every integer-quantized projection weight, whatever format wrote it.

A weight W [N, K] (N outputs, K inputs) is stored as unsigned codes with a scale and a zero point per group of
`group_size` consecutive input columns: W[n, k] = (codes[n, k] - zero[n, k // G]) * scale[n, k // G]. Symmetric
formats have zero = 2**(bits - 1); a format with one scale per output row has G = K. FP8 weights (`float8`) keep
their float8_e4m3fn bytes as the codes, read as the float they encode, with zero 0: W = fp8(codes) * scale (a
per-tensor scale repeated per row, a 128x128 block's scale repeated over its 128 rows). GPTQ's act-order (`g_idx`)
puts a column's group anywhere: its columns are sorted by group at load, so groups are runs again, and `perm` says
which input column each stored column is (the kernels read x[:, perm]). With one scale per row the order does not
matter, and such weights keep the inputs' own order (no `perm`).

The loader handles it like a float tensor: rows of q, k and v (gate and up) are concatenated (`cat_rows`), tensor
parallelism takes rows or columns, the MLP splits gate from up (slicing).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from overlap.engine.errors import ModelLoadError

log = logging.getLogger("overlap.engine")
_SPLIT_SHARDS_LOGGED: set[tuple[int, int, int]] = set()  # (start, stop, group) warned of


@dataclass(slots=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K], 0 .. 2**bits - 1; columns in `perm` order when perm is set
    scale: torch.Tensor  # float32 [N, K // group_size]
    zero: torch.Tensor  # float32 [N, K // group_size]: the code that stands for 0.0
    bits: int  # 4 or 8
    group_size: int  # input columns per scale; K for one scale per output row
    fmt: str  # the checkpoint's format, for logs and the engine's info ("compressed-tensors W4A16", "gptq", ...)
    perm: torch.Tensor | None = None  # int64 [K]: stored column j is input column perm[j] (act-order)
    act_bits: int | None = None  # 8: activations are quantized to int8 per token at run time (W8A8); None: 16-bit
    dtype: torch.dtype = torch.float32  # the model's dtype: what the kernels take and return
    float8: bool = False  # the codes are float8_e4m3fn bytes (zero 0), not integers

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def symmetric(self) -> bool:
        return bool((self.zero == (0 if self.float8 else 2 ** (self.bits - 1))).all())

    @property
    def per_row(self) -> bool:
        """One scale per output row (per-channel), no groups along the inputs."""
        return self.group_size == self.codes.shape[1]

    def same_layout(self, other: QuantizedWeight) -> bool:
        """Whether the rows of `other` can be stacked under these (one matmul for q|k|v or gate|up)."""
        same_perm = (self.perm is None and other.perm is None) or (
            self.perm is not None and other.perm is not None and torch.equal(self.perm, other.perm)
        )
        return (self.bits, self.group_size, self.act_bits, self.fmt, self.float8) == (
            other.bits, other.group_size, other.act_bits, other.fmt, other.float8) and same_perm  # fmt: skip

    def to(self, device: torch.device, dtype: torch.dtype) -> QuantizedWeight:
        """On `device`, computing in `dtype` (codes, scales and zero points keep their own types)."""
        moved = self._rows(lambda t: t.to(device))
        moved.perm = None if self.perm is None else self.perm.to(device)
        moved.dtype = dtype
        return moved

    def _rows(self, pick) -> QuantizedWeight:
        return dataclasses.replace(self, codes=pick(self.codes), scale=pick(self.scale), zero=pick(self.zero))

    def __getitem__(self, rows: slice) -> QuantizedWeight:
        return self._rows(lambda t: t[rows])

    def columns(self, start: int, stop: int, name: str) -> QuantizedWeight | torch.Tensor:
        """Input columns [start, stop) (a row-parallel shard): whole groups only, else ModelLoadError with the sizes;
        act-order weights whose groups the shard splits come back dequantized (a float tensor)."""
        group = self.group_size
        if self.per_row:  # one scale per row: any columns (act-order is undone at load for these)
            return dataclasses.replace(self, codes=self.codes[:, start:stop], group_size=stop - start)
        if self.perm is not None:
            return self._columns_by_perm(start, stop, name)
        if start % group or stop % group:
            raise ModelLoadError(f"{name}: a tensor-parallel shard takes input columns [{start}, {stop}), which "
                                 f"splits its quantization groups of {group}; use a size whose shards hold whole "
                                 "groups")  # fmt: skip
        g0, g1 = start // group, stop // group
        return dataclasses.replace(self, codes=self.codes[:, start:stop], scale=self.scale[:, g0:g1],
                                   zero=self.zero[:, g0:g1])  # fmt: skip

    def _columns_by_perm(self, start: int, stop: int, name: str) -> QuantizedWeight | torch.Tensor:
        """The shard's columns; where they split act-order groups (a group's columns lie anywhere in the inputs, so a
        real act-order checkpoint's shards nearly always do), the shard dequantized to the model's dtype."""
        keep = (self.perm >= start) & (self.perm < stop)
        group = self.group_size
        groups = keep.view(-1, group)
        if not bool((groups.all(1) | ~groups.any(1)).all()):
            if (start, stop, group) not in _SPLIT_SHARDS_LOGGED:  # once: a mixture has thousands of such experts
                _SPLIT_SHARDS_LOGGED.add((start, stop, group))
                log.warning("%s: a tensor-parallel shard of input columns [%d, %d) splits act-order groups of %d: "
                            "this shard, and any other like it, is dequantized at load",
                            name, start, stop, group)  # fmt: skip
            return self.dequantize(torch.float32)[:, start:stop].contiguous()  # the loader casts it to the model's
        whole = groups.all(1)
        return dataclasses.replace(self, codes=self.codes[:, keep], scale=self.scale[:, whole],
                                   zero=self.zero[:, whole], perm=self.perm[keep] - start)  # fmt: skip

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in the input columns' own order (the reference every kernel is checked against)."""
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        zero = self.zero.repeat_interleave(self.group_size, dim=1)
        values = self.codes.view(torch.float8_e4m3fn).float() if self.float8 else self.codes.float()
        w = (values - zero) * scale
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm.to(w.device), w)
        return w.to(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel streams: the codes at `bits` each, a scale and a zero point a group at 4 bytes (fp32, as
        quant_w4a16.c reads them)."""
        n, k = self.codes.shape
        return n * k * self.bits // 8 + 4 * (self.scale.numel() + self.zero.numel())


def random_quantized(n: int, k: int, scheme: WeightScheme, fmt: str, device: torch.device,
                     generator: torch.Generator, dtype: torch.dtype) -> QuantizedWeight:  # fmt: skip
    """Random symmetric codes of an [n, k] weight, made on the device, scaled to spread as Normal(0, 0.02) does (for
    benchmarks of model shapes, `loader.random_weights`)."""
    group = scheme.group_size
    if scheme.float8:  # Normal(0, 1) rounded to FP8, scaled by 0.02
        values = torch.empty(n, k, device=device).normal_(0.0, 1.0, generator=generator)
        codes, spread, zero = values.to(torch.float8_e4m3fn).view(torch.uint8), 0.02, 0.0
    else:
        # 1 .. 2**bits - 1 around the zero point 2**(bits - 1): mean 0 (with 0 among the codes, 4 bits would have
        # mean -0.5, a tenth of their spread: a common direction in every output that sends every token's router
        # to the same few experts)
        values = 2**scheme.bits - 1
        codes = torch.randint(1, 2**scheme.bits, (n, k), generator=generator, device=device, dtype=torch.uint8)
        spread = 0.02 / ((values**2 - 1) / 12) ** 0.5  # a uniform code's standard deviation
        zero = 2.0 ** (scheme.bits - 1)
    scale = torch.full((n, k // group), spread, device=device)
    return QuantizedWeight(codes, scale, torch.full_like(scale, zero), scheme.bits, group, fmt,
                           act_bits=scheme.act_bits, dtype=dtype, float8=scheme.float8)  # fmt: skip


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How a format stores one projection (for random weights of its layout)."""

    bits: int
    group_size: int
    act_bits: int | None = None
    float8: bool = False


def as_float(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a float tensor: a QuantizedWeight dequantized to `dtype`, a tensor as it is."""
    return weight.dequantize(dtype) if isinstance(weight, QuantizedWeight) else weight


def cat_rows(parts: list, dtype: torch.dtype):
    """q|k|v or gate|up as one weight: float tensors concatenated; quantized ones stacked where they share a layout,
    else (a part the format left unquantized, act-order parts with different column orders) dequantized to `dtype`."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    first = parts[0]
    if all(isinstance(p, QuantizedWeight) and first.same_layout(p) for p in parts):
        return dataclasses.replace(first, codes=torch.cat([p.codes for p in parts]),
                                   scale=torch.cat([p.scale for p in parts]),
                                   zero=torch.cat([p.zero for p in parts]))  # fmt: skip
    return torch.cat([as_float(p, dtype) for p in parts])
