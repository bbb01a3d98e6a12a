"""`overlap model fetch URI`: a model into the cache once, then a link to it (the pod's init container).

A second fetch of the same source and version (another replica on the node, or on a shared cache) finds it there
and fetches nothing; two at once take turns on the key's lock, and the second finds the first one's result.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from overlap.engine.delivery.cache import ModelCache, folder_bytes
from overlap.engine.delivery.sources import FetchError, source_for
from overlap.engine.delivery.uri import ModelURIError, parse

PROGRESS_EVERY_S = 5.0


def fetch(
    uri_text: str,
    cache_dir: str | Path,
    *,
    link: str | Path | None = None,
    token: str | None = None,
    stall_s: float = 30.0,
    max_cache_bytes: int | None = None,
    keep: Collection[Path] = (),
    progress: Callable[[str], None] = print,
) -> tuple[Path, int]:
    """(the model's folder in the cache, bytes fetched: 0 when it was there). FetchError says what failed. The
    eviction keeps the folders in `keep` too (a draft's fetch keeps the model fetched before it)."""
    try:
        uri = parse(uri_text)
    except ModelURIError as exc:
        raise FetchError(str(exc)) from exc
    source = source_for(uri, token=token, stall_s=stall_s)
    key, total = source.resolve()
    cache = ModelCache(cache_dir)
    fetched = 0
    if cache.has(key):
        cache.touch(key)
        progress(f"{uri}: in the cache at {cache.path(key)}; nothing to fetch")
    else:
        with cache.locked(key, waiting=lambda: progress(f"{uri}: another fetch of it is under way; waiting")):
            if cache.has(key):
                progress(f"{uri}: fetched meanwhile by another pod, at {cache.path(key)}")
            else:
                partial = cache.partial(key)
                partial.mkdir(parents=True, exist_ok=True)
                already = folder_bytes(partial)
                started = time.monotonic()
                with _Reporter(str(uri), partial, total, progress):
                    source.download(partial)
                fetched = max(0, folder_bytes(partial) - already)
                seconds = time.monotonic() - started
                cache.commit(key)
                rate = fetched / seconds / 1e6 if seconds > 0 else 0.0
                progress(f"{uri}: fetched {fetched / 1e9:.2f} GB in {seconds:.1f} s ({rate:.0f} MB/s)"
                         f" into {cache.path(key)}")  # fmt: skip
    if max_cache_bytes is not None:
        kept = {key, *(Path(folder).relative_to(cache.root).as_posix() for folder in keep)}
        for evicted in cache.evict(max_cache_bytes, keep=kept):
            progress(f"cache over {max_cache_bytes / 1e9:.1f} GB: evicted {evicted}")
    if link is not None:
        _link(Path(link), cache.path(key))
    return cache.path(key), fetched


def _link(link: Path, target: Path) -> None:
    """`link` -> `target`, replaced in one rename."""
    link.parent.mkdir(parents=True, exist_ok=True)
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)


class _Reporter:
    """A progress line every PROGRESS_EVERY_S while a fetch runs: bytes so far, of how many, and the rate."""

    def __init__(self, what: str, folder: Path, total: int | None, progress: Callable[[str], None]) -> None:
        self.what, self.folder, self.total, self.progress = what, folder, total, progress
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)

    def __enter__(self) -> _Reporter:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        last_bytes, last_time = folder_bytes(self.folder), time.monotonic()
        while not self.stop.wait(PROGRESS_EVERY_S):
            done, now = folder_bytes(self.folder), time.monotonic()
            rate = (done - last_bytes) / (now - last_time) / 1e6
            of = f" of {self.total / 1e9:.2f}" if self.total else ""
            self.progress(f"{self.what}: fetching, {done / 1e9:.2f}{of} GB ({rate:.0f} MB/s)")
            last_bytes, last_time = done, now
