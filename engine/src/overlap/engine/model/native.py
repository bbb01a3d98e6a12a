"""The runner's one native kernel: paged decode attention on CPU, fp32 or bf16 (`paged_attention.c`), built on first
use.

It is plain C with no Python or torch headers, so a build is one `cc` call of about a second; the shared library is
cached under `$OVERLAP_CACHE_DIR/native/` keyed by the source, the flags and the CPU model (the build uses
-march=native), and loaded with ctypes, which releases the GIL for the call. Without a C compiler, or with
`OVERLAP_NATIVE=0`, `decode_attention_kernel()` returns None and the runner uses its torch ops instead (same
results, slower: see docs/engine.md), after one logged warning saying why.
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

_SOURCE = Path(__file__).with_name("paged_attention.c")
# -fopenmp-simd honours the `omp simd` pragmas without linking an OpenMP runtime (torch brings its own).
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC"]
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
            fn.argtypes += [_i32, _f32]
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
    ) -> None:
        """q [rows, heads, D] (rows may be strided, heads and D dense); k/v pool [slots, kv_heads, D] contiguous;
        out [rows, heads, D] contiguous. All of one dtype, fp32 or bf16, on CPU."""
        heads, head_dim = q.shape[1], q.shape[2]
        fn = self._fns.get(q.dtype)
        if fn is None or not (k_pool.dtype == v_pool.dtype == out.dtype == q.dtype):
            raise ValueError(f"paged decode attention: q, pools and out must all be fp32 or all bf16, got {q.dtype}")
        # The C code trusts these layouts; a mismatch would read or write the wrong memory, so check them (cheap).
        if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError("paged decode attention: q rows must be dense [heads, head_dim], the pools contiguous")
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
        )
        if status != 0:
            raise MemoryError("paged decode attention: could not allocate its scratch buffer")


class DecodePlan:
    """The decodes of one step in the kernel's terms, built once per step and shared by every layer."""

    __slots__ = ("block_size", "block_tables", "ctx_lens", "mid", "num_seqs", "q_rows", "table_starts")

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
        # Where to cut the sequences in two runs of about equal context, for two threads (work is linear in it).
        half, acc, self.mid = sum(ctx_lens) / 2, 0, len(ctx_lens) // 2
        for i, n in enumerate(ctx_lens[:-1]):
            acc += n
            if acc >= half:
                self.mid = i + 1
                break


@functools.cache
def decode_attention_kernel() -> DecodeAttentionKernel | None:
    """The kernel, built and cached on first use; None (and one warning) when it cannot be had."""
    if os.environ.get("OVERLAP_NATIVE", "1") == "0":
        log.info("native decode attention off (OVERLAP_NATIVE=0): using torch ops")
        return None
    try:
        return DecodeAttentionKernel(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("native decode attention unavailable (%s); using torch ops, slower at decode", detail)
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    target = cache_root() / "native" / f"paged_attention-{platform.machine()}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent first uses (test workers, two processes) never load a
    # half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], check=True, capture_output=True, text=True)
        os.replace(built, target)
    return target


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


def _cpu_model() -> str:
    """The CPU's model name and feature flags: a library built with -march=native is only reused on a like CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(("model name", "flags"))))
