"""The runner's one helper thread: it takes the second half of a step's batch, or every other decode's attention.

Python threads, not OpenMP: torch and the native kernels release the GIL inside each kernel, and there is no
barrier per kernel. Made on first use.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class HelperThread:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-attn")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
