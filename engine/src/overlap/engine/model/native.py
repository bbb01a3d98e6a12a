"""The runner's native kernels on CPU, fp32 or bf16: paged decode attention (`paged_attention.c`), a layer's small
ops, RMSNorm and RoPE with the K/V write, and the sampler's greedy argmax (`cpu_ops.c`), and a projection's LoRA
delta over mixed adapters (`lora_delta.c`), built into one library on first use; projections at decode sizes
(`linear_packed.c`), built into a second one with OpenMP; and quantized projections (`quant_w4a16.c`,
`quant_w8a8.c`), a third.

It is plain C with no Python or torch headers, so a build is one `cc` call of about a second; the shared library is
cached under `$OVERLAP_CACHE_DIR/native/` keyed by the sources, the flags and the CPU model (the build uses
-march=native, so the compiler picks the instructions this CPU has: AVX2, AVX-512, AVX512-BF16), and loaded with
ctypes, which releases the GIL for the call. Without a C compiler, or with `OVERLAP_NATIVE=0`,
`decode_attention_kernel()`, `cpu_ops()` and `lora_kernel()` return None and the runner uses its torch ops instead
(same results, slower: see docs/engine.md), after one logged warning saying why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import ClassVar

import torch

from overlap.engine.model.builder import cache_root

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.c", "cpu_ops.c", "lora_delta.c", "bf16.h")]
# -fopenmp links libgomp.so.1 by name, which resolves to the copy torch loaded: torch's threads run the kernels.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
_LINEAR_SOURCES = [Path(__file__).with_name("linear_packed.c")]
_LINEAR_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_QUANT_SOURCES = [
    Path(__file__).with_name(name) for name in ("quant_w4a16.c", "quant_w8a8.c", "quant_linear.h", "bf16.h")
]
_LIBRARIES = {"overlap_kernels": (_SOURCES, _FLAGS), "overlap_linear": (_LINEAR_SOURCES, _LINEAR_FLAGS),
              "overlap_quant": (_QUANT_SOURCES, [*_LINEAR_FLAGS, "-lm"])}  # fmt: skip
_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class DecodeAttentionKernel:
    """`paged_attention.c` loaded; `__call__` runs sequences [begin, end) of a prepared `DecodePlan`."""

    ENTRY_POINTS: ClassVar[dict[torch.dtype, str]] = {
        torch.float32: "overlap_paged_decode_attention",
        torch.bfloat16: "overlap_paged_decode_attention_bf16",
    }
    DTYPES = tuple(ENTRY_POINTS)

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, name in self.ENTRY_POINTS.items():
            fn = getattr(library, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _i32]
            fn.argtypes += [_i32, _f32, _f32, _ptr, _i32]
            self._fns[dtype] = fn

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        plan: DecodePlan,
        out: torch.Tensor,
        begin: int,
        end: int,
        scale: float,
        threads: int = 1,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """q [rows, heads, D] (rows may be strided, heads and D dense); k/v pool [slots, kv_heads, D] contiguous;
        out [rows, heads, D] contiguous. All of one dtype, fp32 or bf16, on CPU. `threads` OpenMP threads share the
        sequences. `softcap` (Gemma 2): scaled scores s become softcap * tanh(s / softcap) before the softmax.
        `sinks` (gpt-oss): fp32 [heads], one logit per head that joins its softmax's denominator."""
        heads, head_dim = q.shape[1], q.shape[2]
        fn = self._fns.get(q.dtype)
        if fn is None or not (k_pool.dtype == v_pool.dtype == out.dtype == q.dtype):
            raise ValueError(f"paged decode attention: q, pools and out must all be fp32 or all bf16, got {q.dtype}")
        # The C code trusts these layouts; a mismatch would read or write the wrong memory, so check them (cheap).
        if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError("paged decode attention: q rows must be dense [heads, head_dim], the pools contiguous")
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (heads,) or not sinks.is_contiguous()):
            raise ValueError(f"paged decode attention: sinks must be fp32 [{heads}], got {sinks.dtype} "
                             f"{tuple(sinks.shape)}")  # fmt: skip
        if not out.is_contiguous() or out.shape[1:] != q.shape[1:] or k_pool.shape[2] != head_dim:
            raise ValueError(
                f"paged decode attention: shapes q {tuple(q.shape)}, out {tuple(out.shape)}, "
                f"pool {tuple(k_pool.shape)} do not match"
            )
        status = fn(
            q.data_ptr(),
            q.stride(0),
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            plan.block_tables.data_ptr(),
            plan.table_starts.data_ptr(),
            plan.ctx_lens.data_ptr(),
            plan.q_rows.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            begin,
            end,
            heads,
            k_pool.shape[1],
            head_dim,
            plan.block_size,
            scale,
            softcap or 0.0,
            None if sinks is None else sinks.data_ptr(),
            threads,
        )
        if status != 0:
            raise MemoryError("paged decode attention: could not allocate its scratch buffer")


class DecodePlan:
    """The decodes of one step in the kernel's terms, built once per step and shared by every layer."""

    __slots__ = ("block_size", "block_tables", "ctx_lens", "num_seqs", "q_rows", "table_starts")

    def __init__(self, tables: list[list[int]], ctx_lens: list[int], q_rows: list[int], block_size: int) -> None:
        starts, flat = [], []
        for table in tables:
            starts.append(len(flat))
            flat.extend(table)
        self.block_tables = torch.tensor(flat, dtype=torch.int32)
        self.table_starts = torch.tensor(starts, dtype=torch.int32)
        self.ctx_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        self.q_rows = torch.tensor(q_rows, dtype=torch.int32)
        self.block_size = block_size
        self.num_seqs = len(ctx_lens)


class CpuOps:
    """`cpu_ops.c` loaded: RMSNorm, RoPE with the K/V write, greedy argmax and a gated MLP's silu(gate) * up, over a
    step's rows in one call each."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms_norm = library.overlap_rms_norm
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i32, _i32, _f32, _i32, _i32]
        self._rope = library.overlap_rope_store_kv
        self._rope.restype = None
        self._rope.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _i32, _i32, _i32]
        self._argmax = library.overlap_argmax_rows
        self._argmax.restype = None
        self._argmax.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _i32, _i32]
        self._silu_mul = library.overlap_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _i32, _i32]

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of fp32 or bf16 x [rows, cols] (rows may be strided): int64 [rows], the rows shared
        among torch's threads."""
        _check(x.dtype in DecodeAttentionKernel.DTYPES, "argmax: fp32 or bf16")
        _check(x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0, "argmax: layout")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), x.dtype == torch.bfloat16,
                     torch.get_num_threads())  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate_up[:, :I]) * gate_up[:, I:] for fp32 or bf16 gate_up [rows, 2 I] (rows may be strided), one
        rounding, one pass: a new [rows, I]."""
        rows, width = gate_up.shape
        _check(gate_up.dtype in DecodeAttentionKernel.DTYPES and gate_up.stride(1) == 1 and width % 2 == 0,
               "silu_mul: rows of [gate | up], fp32 or bf16")  # fmt: skip
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, width // 2, out.data_ptr(),
                       gate_up.dtype == torch.bfloat16, torch.get_num_threads())  # fmt: skip
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """torch's rms_norm over the last dim of x [rows, hidden] (rows may be strided), one rounding: a new tensor.
        The weight is x's dtype, or fp32 (Gemma's 1 + w) beside bf16 x."""
        rows, hidden = x.shape
        _check(x.dtype in DecodeAttentionKernel.DTYPES and weight.dtype in (x.dtype, torch.float32),
               "rms_norm: x fp32 or bf16, the weight x's dtype or fp32")  # fmt: skip
        _check(x.stride(1) == 1 and weight.is_contiguous() and weight.shape == (hidden,), "rms_norm: layouts")
        out = torch.empty(rows, hidden, dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), hidden, rows, hidden, eps,
                       x.dtype == torch.bfloat16, weight.dtype == torch.bfloat16)  # fmt: skip
        return out

    def rope_store_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        slots: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        heads: int,
    ) -> None:
        """RoPE on the q and k heads of qkv [tokens, (heads + 2 kv_heads) * head_dim] in place, then each token's K
        and V heads into its slot of the pools [slots, kv_heads, head_dim]. cos/sin_signed [positions, head_dim]
        (sin's first half negated: rotate-half form); positions and slots int64 [tokens]."""
        tokens = qkv.shape[0]
        kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
        dtype = qkv.dtype
        same_dtype = all(t.dtype == dtype for t in (cos, sin_signed, k_pool, v_pool))
        _check(dtype in DecodeAttentionKernel.DTYPES and same_dtype, "rope: fp32 or bf16 throughout")
        _check(positions.dtype == slots.dtype == torch.int64 and positions.shape == slots.shape == (tokens,),
               "rope: positions and slots int64, one per token")  # fmt: skip
        _check(qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim, "rope: qkv rows")
        _check(all(t.is_contiguous() for t in (cos, sin_signed, k_pool, v_pool, positions, slots))
               and cos.shape[1] == head_dim == sin_signed.shape[1], "rope: tables and pools contiguous")  # fmt: skip
        self._rope(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
                   slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tokens, heads, kv_heads, head_dim,
                   dtype == torch.bfloat16)  # fmt: skip


class LoraKernel:
    """`lora_delta.c` loaded: one projection's LoRA delta for every row of a step, whatever their adapters."""

    DTYPES = (torch.float32, torch.bfloat16)
    # rows above which one adapter's rows (a prefill) go through its pair of oneDNN matmuls instead (lora.py); with
    # several adapters in a step the kernel stays: the matmuls' cost grows with each adapter's gathered copies
    ROWS_ONE_ADAPTER = 48

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.overlap_lora_delta
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i32, _ptr, _ptr, _i32, _i32, _i32, _ptr, _ptr, _i32,
                             _i32, _i32]  # fmt: skip

    @staticmethod
    def weights(a: torch.Tensor, bt: torch.Tensor, spans: torch.Tensor, seg_cols: torch.Tensor) -> tuple:
        """One projection's slots, checked once, as `__call__` takes them (its tensors are filled in place after):
        a [slots, R, in] and bt (B transposed) [slots, R, out] contiguous, one dtype, fp32 or bf16; seg_cols (int32
        [segments + 1]): where each column segment of y starts, then out; spans (int32 [slots, segments, 2]): the
        ranks [lo, hi) where B is not zero in each (the rest is skipped)."""
        segments = seg_cols.numel() - 1
        _check(a.dtype in LoraKernel.DTYPES and bt.dtype == a.dtype and a.is_contiguous() and bt.is_contiguous()
               and a.dim() == bt.dim() == 3 and a.shape[:2] == bt.shape[:2], "lora: A and B^T")  # fmt: skip
        _check(spans.dtype == seg_cols.dtype == torch.int32 and spans.shape == (a.shape[0], segments, 2)
               and spans.is_contiguous() and seg_cols.is_contiguous() and int(seg_cols[-1]) == bt.shape[2],
               "lora: spans and column segments")  # fmt: skip
        return (a, bt, spans, seg_cols, a.data_ptr(), bt.data_ptr(), a.shape[1], a.shape[2], bt.shape[2],
                spans.data_ptr(), seg_cols.data_ptr(), segments, a.dtype == torch.bfloat16)  # fmt: skip

    def __call__(self, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor, slots: torch.Tensor,
                 weights: tuple) -> None:  # fmt: skip
        """y[r] += bt[s].T (a[s] x[r]) in place for each row r in `order` (int32, rows grouped by slot), s = slots[r]
        (int32, one per row of x); x [rows, in] and y [rows, out] (rows may be strided) in the weights' dtype;
        `weights` from `weights()`."""
        a, _, _, _, a_ptr, bt_ptr, rank, inputs, outputs, spans_ptr, cols_ptr, segments, bf16 = weights
        rows = x.shape[0]
        _check(x.dtype == y.dtype == a.dtype and x.stride(1) == y.stride(1) == 1 and x.shape[1] == inputs
               and y.shape == (rows, outputs) and slots.shape == (rows,) and order.numel() <= rows,
               "lora: x, y, order and slots")  # fmt: skip
        status = self._fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), order.data_ptr(), slots.data_ptr(),
                          order.numel(), a_ptr, bt_ptr, rank, inputs, outputs, spans_ptr, cols_ptr, segments, bf16,
                          torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise MemoryError("lora delta: could not allocate its scratch buffer")


class PackedLinearKernel:
    """`linear_packed.c` loaded: y = x W^T (+ bias) (SiLU) for 1-64 rows of fp32 or bf16 against a weight in oneDNN's
    packed layout for that dtype (`layers/linear.py` checks the layout on this CPU before it hands one over)."""

    MAX_ROWS = 64  # what the kernel takes; `rows` is where it is faster than oneDNN on this CPU (docs/engine.md)
    # The most rows it takes from oneDNN, by how the CPU runs a 512-bit instruction (bench/linear_rows.py measures it):
    # split in two halves (AMD Zen 4), oneDNN's compute-bound kernels run at half rate and the stream wins up to 64
    # rows; whole (AMD Zen 5, Intel's AVX-512 cores), oneDNN is level from 16 rows and ahead above. AVX2: 256 bits.
    ROWS_SPLIT_512: ClassVar[dict[torch.dtype, int]] = {torch.bfloat16: 64, torch.float32: 48}
    ROWS_WHOLE_512: ClassVar[dict[torch.dtype, int]] = {torch.bfloat16: 8, torch.float32: 8}
    ROWS_AVX2: ClassVar[dict[torch.dtype, int]] = {torch.float32: 48}
    BLOCK_COLS = 64  # the packed layout's output-column block
    K_ALIGN: ClassVar[dict[torch.dtype, int]] = {torch.bfloat16: 32, torch.float32: 16}  # what inputs are padded to
    PAIRED: ClassVar[dict[torch.dtype, int]] = {torch.bfloat16: 2, torch.float32: 1}  # inputs side by side per column

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.overlap_linear_packed
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i32, _ptr, _i64, _i32, _i32]
        self._experts = library.overlap_experts_packed
        self._experts.restype = ctypes.c_int
        self._experts.argtypes = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i32, _i32]
        available = library.overlap_linear_packed_dtypes()
        self.dtypes = tuple(dtype for bit, dtype in ((1, torch.float32), (2, torch.bfloat16)) if available & bit)
        self.isa = "AVX-512" if library.overlap_linear_packed_isa() == 512 else "AVX2"
        self.rows = (self.ROWS_AVX2 if self.isa == "AVX2"
                     else self.ROWS_SPLIT_512 if splits_512_bit_ops() else self.ROWS_WHOLE_512)  # fmt: skip

    def padded_k(self, k: int, dtype: torch.dtype) -> int:
        return -(-k // self.K_ALIGN[dtype]) * self.K_ALIGN[dtype]

    def packed_bytes(self, n: int, k: int, dtype: torch.dtype) -> int:
        """The bytes of an [n, k] weight in the layout this kernel reads."""
        return -(-n // self.BLOCK_COLS) * self.BLOCK_COLS * self.padded_k(k, dtype) * dtype.itemsize

    @staticmethod
    def reads_rows_of(x: torch.Tensor) -> bool:
        """x's rows lie as the kernel reads them: dense, and in bf16 (read in pairs) 4-byte aligned, which a slice
        of a wider tensor may not be."""
        bf16 = x.dtype == torch.bfloat16
        return x.stride(1) == 1 and (not bf16 or (x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0))

    def __call__(self, x: torch.Tensor, weight_ptr: int, n: int, k: int, bias: torch.Tensor | None,
                 silu: bool) -> torch.Tensor:  # fmt: skip
        """x [rows, k], 1 <= rows <= MAX_ROWS, its rows as `reads_rows_of` says; a new [rows, n]."""
        rows, dtype, bf16 = x.shape[0], x.dtype, x.dtype == torch.bfloat16
        _check(dtype in self.dtypes and x.dim() == 2 and x.shape[1] == k and self.reads_rows_of(x)
               and 1 <= rows <= self.MAX_ROWS, "linear: x layout")  # fmt: skip
        _check(bias is None or (bias.dtype == dtype and bias.is_contiguous() and bias.shape == (n,)), "linear: bias")
        out = torch.empty(rows, n, dtype=dtype)
        status = self._fn(x.data_ptr(), x.stride(0), rows, weight_ptr, n, k, self.padded_k(k, dtype),
                          None if bias is None else bias.data_ptr(), silu, out.data_ptr(), n, torch.get_num_threads(),
                          bf16)  # fmt: skip
        _check(status == 0, "linear: arguments the kernel does not take")
        return out

    def experts(self, x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, inter: int) -> torch.Tensor:  # fmt: skip
        """A mixture of experts' gated MLPs, down(silu(x gate^T) * (x up^T)), expert e over its counts[e] rows of x
        (x [rows, H] dense, sorted by expert; counts int64 [E], each at most MAX_ROWS), in one call; gate, up and
        down are int64 [E] addresses of each expert's packed weights ([inter, H], [inter, H], [H, inter]). A new
        [rows, H]."""
        rows, hidden, dtype = x.shape[0], x.shape[1], x.dtype
        _check(dtype in self.dtypes and x.is_contiguous() and x.data_ptr() % 4 == 0, "experts: x layout")
        _check(counts.dtype == torch.int64 and counts.is_contiguous() and int(counts.sum()) == rows,
               "experts: counts")  # fmt: skip
        _check(all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == counts.shape for t in (gate, up, down)),
               "experts: weight addresses")  # fmt: skip
        act = torch.empty(rows, inter, dtype=dtype)
        out = torch.empty(rows, hidden, dtype=dtype)
        status = self._experts(x.data_ptr(), counts.data_ptr(), counts.shape[0], gate.data_ptr(), up.data_ptr(),
                               down.data_ptr(), hidden, self.padded_k(hidden, dtype), inter,
                               self.padded_k(inter, dtype), act.data_ptr(), out.data_ptr(), torch.get_num_threads(),
                               dtype == torch.bfloat16)  # fmt: skip
        _check(status == 0, "experts: arguments the kernel does not take")
        return out


class QuantLinearKernel:
    """`quant_w4a16.c` and `quant_w8a8.c` loaded: W4A16 projections for 1-64 rows of x, W8A8 ones for any number, and a
    W4A16 weight dequantized into a float buffer. `isa` says which path this CPU got: "AVX-512 VNNI", "AVX-512",
    "AVX2" or "C"."""

    MAX_ROWS = 64
    MAX_K = 65536  # the W8A8 kernel's widest input (quant_linear.h: its int32 sums)
    ISAS = ("C", "AVX2", "AVX-512", "AVX-512 VNNI")

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = self.ISAS[library.overlap_quant_linear_isa()]
        self._bf16_path = library.overlap_w4a16_bf16_path
        self._bf16_path.restype = ctypes.c_int
        self._bf16_path.argtypes = [_i64, _i64]
        self._w4 = library.overlap_w4a16_rows
        self._w4.restype = ctypes.c_int
        self._w4.argtypes = [_ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i32]
        self._w4_dequantize = library.overlap_w4a16_dequantize
        self._w4_dequantize.restype = ctypes.c_int
        self._w4_dequantize.argtypes = [_ptr, _ptr, _ptr, _f32, _i64, _i64, _i64, _ptr, _i32, _i32]
        self._w4_tiles = library.overlap_w4a16_tiles
        self._w4_tiles.restype = ctypes.c_int
        self._w4_tiles.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i32]
        self._w8a8_quantize = library.overlap_w8a8_quantize
        self._w8a8_quantize.restype = ctypes.c_int
        self._w8a8_quantize.argtypes = [_ptr, _i64, _i32, _i32, _i64, _ptr, _ptr, _i32]
        self._w8a8_scale_rows = library.overlap_w8a8_scale_rows
        self._w8a8_scale_rows.restype = ctypes.c_int
        self._w8a8_scale_rows.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i32, _i32]
        self._w8a8_packed_size = library.overlap_w8a8_packed_size
        self._w8a8_packed_size.restype = _i64
        self._w8a8_packed_size.argtypes = [_i64, _i64]
        self._w8a8_pack = library.overlap_w8a8_pack
        self._w8a8_pack.restype = ctypes.c_int
        self._w8a8_pack.argtypes = [_ptr, _i64, _i64, _ptr]
        self._w8a8 = library.overlap_w8a8
        self._w8a8.restype = ctypes.c_int
        self._w8a8.argtypes = [_ptr, _i64, _i32, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i32, _i32]

    def bf16_path(self, k: int, group: int) -> bool:
        """Whether bf16 x of this width and group runs through vdpbf16ps (AVX512-BF16), which wants
        offset = scale * (128 + zero) (else scale * zero)."""
        return bool(self._bf16_path(k, group))

    @staticmethod
    def _rows(x: torch.Tensor, keep_bf16: bool = False) -> torch.Tensor:
        _check(x.dim() == 2 and 1 <= x.shape[0] <= QuantLinearKernel.MAX_ROWS, "quantized linear: x rows")
        return x.contiguous() if keep_bf16 and x.dtype == torch.bfloat16 else x.float().contiguous()

    def _check_w4(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> None:
        n, k = codes.shape[0], 2 * codes.shape[1]
        _check(codes.dtype == torch.uint8 and codes.is_contiguous() and scale.dtype == offset.dtype == torch.float32
               and scale.is_contiguous() and offset.is_contiguous() and scale.shape == offset.shape == (n, k // group),
               "quantized linear: W4A16 weight")  # fmt: skip

    def w4a16(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
              group: int) -> torch.Tensor:  # fmt: skip
        """x [rows, K] (fp32 or bf16) times the weight of `codes` [N, K/2] (two inputs a byte, the first in the low
        nibble), `scale` and `offset` [N, K/group] fp32 (scale * zero; scale * (128 + zero) where `bf16_path` holds
        for bf16 x): a new fp32 [rows, N]."""
        x = self._rows(x, keep_bf16=True)
        n, k = codes.shape[0], 2 * codes.shape[1]
        self._check_w4(codes, scale, offset, group)
        _check(x.shape[1] == k, "quantized linear: x width")
        out = torch.empty(x.shape[0], n)
        status = self._w4(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, x.shape[0], codes.data_ptr(),
                          scale.data_ptr(), offset.data_ptr(), n, k, group, out.data_ptr(), n,
                          torch.get_num_threads())  # fmt: skip
        _check(status == 0, "quantized linear: W4A16 arguments the kernel does not take")
        return out

    def w4a16_dequantize(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: float,
                         group: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """The weight [N, K] in `dtype` (fp32 or bf16): (code + bias) * scale - offset."""
        n, k = codes.shape[0], 2 * codes.shape[1]
        self._check_w4(codes, scale, offset, group)
        _check(dtype in (torch.float32, torch.bfloat16), "quantized linear: dequantize dtype")
        out = torch.empty(n, k, dtype=dtype)
        status = self._w4_dequantize(codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), bias, n, k, group,
                                     out.data_ptr(), dtype == torch.bfloat16, torch.get_num_threads())  # fmt: skip
        _check(status == 0, "quantized linear: W4A16 arguments the kernel does not take")
        return out

    def w4a16_tiles(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    group: int) -> torch.Tensor | None:  # fmt: skip
        """bf16 x [rows, K] (any number of rows) times the weight of `codes`, `scale` and `offset` as `w4a16` takes
        them on its bf16 path (offset = scale * (128 + zero)), the codes made bf16 a block at a time in cache: a new
        bf16 [rows, N]; None where this CPU has no such path (no AVX512-BF16)."""
        _check(x.dim() == 2 and x.shape[0] >= 1 and x.dtype == torch.bfloat16, "quantized linear: W4A16 x")
        x = x.contiguous()
        n, k = codes.shape[0], 2 * codes.shape[1]
        self._check_w4(codes, scale, offset, group)
        _check(x.shape[1] == k, "quantized linear: x width")
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        status = self._w4_tiles(x.data_ptr(), x.stride(0), x.shape[0], codes.data_ptr(), scale.data_ptr(),
                                offset.data_ptr(), n, k, group, out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if status == -2:
            return None
        _check(status == 0, "quantized linear: W4A16 arguments the kernel does not take")
        return out

    def w8a8_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, K] (fp32 or bf16, read as it is) quantized per row as compressed-tensors does: (uint8 code + 128
        [rows, K], fp32 scale [rows, 1])."""
        _check(x.dim() == 2 and x.shape[0] >= 1, "quantized linear: x rows")
        x = x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()
        codes, scales = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.shape[0], 1)
        status = self._w8a8_quantize(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, x.shape[0], x.shape[1],
                                     codes.data_ptr(), scales.data_ptr(), torch.get_num_threads())  # fmt: skip
        _check(status == 0, "quantized linear: W8A8 quantize arguments")
        return codes, scales

    def w8a8_scale_rows(self, sums: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp32 `sums` [rows, N] times x's per-row `x_scale` [rows, 1], rounded once to `dtype` (fp32 or bf16): a new
        [rows, N], as torch.mul(sums, x_scale, out=...) gives it in one pass instead of three."""
        rows, n = sums.shape
        _check(sums.dtype == x_scale.dtype == torch.float32 and sums.is_contiguous() and x_scale.is_contiguous()
               and x_scale.numel() == rows and dtype in (torch.float32, torch.bfloat16),
               "quantized linear: W8A8 scales")  # fmt: skip
        out = torch.empty(rows, n, dtype=dtype)
        status = self._w8a8_scale_rows(sums.data_ptr(), rows, n, x_scale.data_ptr(), out.data_ptr(),
                                       dtype == torch.bfloat16, torch.get_num_threads())  # fmt: skip
        _check(status == 0, "quantized linear: W8A8 scale arguments")
        return out

    def w8a8_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """int8 `weight` [N, K] in the kernel's layout (quant_w8a8.c): a new flat int8 tensor, N padded to 16 and K
        to 4 with zeros, the columns in blocks of 48 whose 4 inputs of 16 columns are one vpdpbusd operand."""
        _check(weight.dim() == 2 and weight.dtype == torch.int8 and weight.is_contiguous(), "quantized linear: W8A8 "
               "weight to pack")  # fmt: skip
        n, k = weight.shape
        packed = torch.empty(self._w8a8_packed_size(n, k), dtype=torch.int8)
        _check(self._w8a8_pack(weight.data_ptr(), n, k, packed.data_ptr()) == 0, "quantized linear: W8A8 pack")
        return packed

    def w8a8(self, x: torch.Tensor, packed: torch.Tensor, rowsum: torch.Tensor, scale: torch.Tensor,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
        """x [rows, K] (fp32 or bf16, read as it is; any number of rows), quantized to int8 per row inside, times
        the int8 weight packed by `w8a8_pack` [N, K], with its int32 `rowsum` [N] and fp32 `scale` [N]: a new
        [rows, N] in `out_dtype` (fp32 or bf16)."""
        _check(x.dim() == 2 and x.shape[0] >= 1, "quantized linear: x rows")
        x = x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()
        n, k = rowsum.shape[0], x.shape[1]
        _check(packed.dtype == torch.int8 and packed.numel() == self._w8a8_packed_size(n, k)
               and rowsum.dtype == torch.int32 and scale.dtype == torch.float32 and rowsum.shape == scale.shape == (n,)
               and rowsum.is_contiguous() and scale.is_contiguous() and out_dtype in (torch.float32, torch.bfloat16),
               "quantized linear: W8A8 weight")  # fmt: skip
        out = torch.empty(x.shape[0], n, dtype=out_dtype)
        status = self._w8a8(x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16, x.shape[0], packed.data_ptr(),
                            rowsum.data_ptr(), scale.data_ptr(), n, k, out.data_ptr(), out_dtype == torch.bfloat16,
                            torch.get_num_threads())  # fmt: skip
        _check(status == 0, "quantized linear: W8A8 arguments the kernel does not take")
        return out


def _check(ok: bool, what: str) -> None:
    # The C code trusts its layouts; a mismatch would read or write the wrong memory, so check them (cheap).
    if not ok:
        raise ValueError(f"native CPU ops: {what}")


@functools.cache
def _library(name: str = "overlap_kernels") -> ctypes.CDLL | None:
    """A native library of `_LIBRARIES`, built and cached on first use; None (and one warning) when it cannot be
    had."""
    if os.environ.get("OVERLAP_NATIVE", "1") == "0":
        log.info("native kernels off (OVERLAP_NATIVE=0): using torch ops")
        return None
    try:
        return ctypes.CDLL(str(_build(name, *_LIBRARIES[name])))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("native kernels unavailable (%s); using torch ops, slower", detail)
        return None


@functools.cache
def decode_attention_kernel() -> DecodeAttentionKernel | None:
    """The decode-attention kernel, or None without the native library."""
    library = _library()
    return None if library is None else DecodeAttentionKernel(library)


@functools.cache
def cpu_ops() -> CpuOps | None:
    """RMSNorm, RoPE with the K/V write, and argmax, or None without the native library."""
    library = _library()
    return None if library is None else CpuOps(library)


@functools.cache
def lora_kernel(march: str | None = None) -> LoraKernel | None:
    """The mixed-adapter LoRA delta, or None without the native library. `march` builds it for another instruction
    set than this CPU's (`x86-64-v3`: the AVX2 path), as `quant_linear_kernel` does."""
    library = _library() if march is None else _library_for("overlap_kernels", march)
    return None if library is None else LoraKernel(library)


@functools.cache
def packed_linear_kernel(march: str | None = None) -> PackedLinearKernel | None:
    """The decode-size projection kernel, or None without the library or AVX2 on this CPU. `march` builds it for
    another instruction set than this CPU's (`x86-64-v3`: the AVX2 path), as `quant_linear_kernel` does."""
    library = _library("overlap_linear") if march is None else _library_for("overlap_linear", march)
    if library is None or not library.overlap_linear_packed_dtypes():
        return None
    return PackedLinearKernel(library)


@functools.cache
def quant_linear_kernel(march: str | None = None) -> QuantLinearKernel | None:
    """The quantized projection kernels, or None without a C compiler. `march` builds them for another instruction
    set than this CPU's (`x86-64-v3`: AVX2, `x86-64`: plain C), so one machine tests every path it can run."""
    library = _library("overlap_quant") if march is None else _library_for("overlap_quant", march)
    return None if library is None else QuantLinearKernel(library)


def _library_for(name: str, march: str) -> ctypes.CDLL:
    """A library of `_LIBRARIES` built for instruction set `march` instead of this CPU's, for tests of other paths."""
    sources, flags = _LIBRARIES[name]
    return ctypes.CDLL(str(_build(name, sources, [f"-march={march}" if f == "-march=native" else f for f in flags])))


def _build(name: str, source_paths: list[Path], flags: list[str]) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    sources = b"".join(path.read_bytes() for path in source_paths)
    key = hashlib.sha256(sources + " ".join([compiler, *flags, _cpu_model()]).encode()).hexdigest()[:16]
    target = cache_root() / "native" / f"{name}-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent first uses (test workers, two processes) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        compiled = [str(path) for path in source_paths if path.suffix == ".c"]
        subprocess.run([compiler, *flags, *compiled, "-o", str(built)], check=True, capture_output=True, text=True)
        os.replace(built, target)
    return target


@functools.cache  # read once: every W8A8 projection asks at load (quant/kernels.py)
def cpu_isa() -> str:
    """The widest matrix/vector instructions this CPU offers the kernels, in one word (from /proc/cpuinfo's flags)."""
    try:
        flags = set(
            next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
        )
    except (OSError, StopIteration):
        return platform.machine()
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                       ("avx2", "AVX2")):  # fmt: skip
        if flag in flags:
            return name
    return "SSE"


@functools.cache  # /proc/cpuinfo read once
def splits_512_bit_ops(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU runs each 512-bit vector instruction as two 256-bit halves: AMD's Zen 4 (family 25 with
    AVX-512) does; Zen 5 and Intel's AVX-512 cores run them whole."""
    try:
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines()[:30] if ":" in line)
    except OSError:
        return False
    info = {key.strip(): value.strip() for key, value in fields.items()}
    return info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"


def _cpu_model() -> str:
    """The CPU's model name and feature flags: a library built with -march=native is only reused on a like CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))
