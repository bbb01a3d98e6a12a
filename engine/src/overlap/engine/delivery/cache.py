"""The model cache: one folder per (source, resolved version), shared by every pod on a node (a hostPath) or on a
shared volume (a ReadWriteMany claim).

    ROOT/KEY/            a complete model: only ever created by a rename, so what is here is whole
    ROOT/.partial/KEY/   a fetch in progress (kept after a failure: the next fetch resumes it)
    ROOT/.locks/KEY.lock one fetch of KEY at a time (flock: a second fetcher waits, then finds it done)

Eviction keeps the complete models under a byte bound, least recently used first, never one that is being
fetched or used now (its lock is held).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

LAST_USED = ".overlap-last-used"  # touched at each use: eviction's clock


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (links not followed)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


class ModelCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        for folder in (self.root, self.root / ".partial", self.root / ".locks"):
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key

    def partial(self, key: str) -> Path:
        return self.root / ".partial" / key

    def has(self, key: str) -> bool:
        return self.path(key).is_dir()

    @contextlib.contextmanager
    def locked(self, key: str, waiting: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold KEY's lock; `waiting` is called once if another process holds it first."""
        with self._lock_file(key).open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None:
                    waiting()
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def commit(self, key: str) -> Path:
        """Move KEY's finished partial folder into place (one rename: readers see all of it or nothing)."""
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.partial(key), final)
        self.touch(key)
        return final

    def touch(self, key: str) -> None:
        (self.path(key) / LAST_USED).touch()

    def entries(self) -> list[tuple[str, int, float]]:
        """(key, bytes, last used) of every complete model."""
        found = []
        for marker in self.root.glob(f"**/{LAST_USED}"):
            folder = marker.parent
            if ".partial" in folder.relative_to(self.root).parts:
                continue
            found.append((folder.relative_to(self.root).as_posix(), folder_bytes(folder), marker.stat().st_mtime))
        return found

    def evict(self, max_bytes: int, keep: Collection[str]) -> list[str]:
        """Remove least recently used models (none in `keep`, none whose lock is held) until the rest fit
        `max_bytes`."""
        entries = sorted(self.entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        removed = []
        for key, size, _ in entries:
            if total <= max_bytes:
                break
            if key in keep:
                continue
            with self._lock_file(key).open("a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # being fetched or used now
                doomed = self.root / ".partial" / f"evicted-{os.getpid()}-{time.monotonic_ns()}"
                os.rename(self.path(key), doomed)  # gone at once for readers; deleted at leisure
                shutil.rmtree(doomed, ignore_errors=True)
            total -= size
            removed.append(key)
        return removed

    def _lock_file(self, key: str) -> Path:
        return self.root / ".locks" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock")
