"""What every model source shares: the error a fetch ends with, retries with backoff, file hashes, and a tar
unpacked into the model folder (an archive's, an image layer's)."""

from __future__ import annotations

import hashlib
import os
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ATTEMPTS = 5  # per file: a 5xx, a dropped connection or a stall is retried, with backoff
T = TypeVar("T")


class FetchError(RuntimeError):
    """A fetch that cannot succeed (or did not within its attempts); the message is the source's own words."""


class Mismatch(Exception):
    """A file whose hash is not the source's: fetched again, then an error."""


class Truncated(Exception):
    """The body ended before Content-Length: resumed at the next attempt."""


def with_retries(what: str, call: Callable[[], T], retryable: Callable[[Exception], bool], backoff_s: float) -> T:
    """`call()`, retried with exponential backoff while it fails with a retryable error."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return call()
        except FetchError:
            raise
        except Exception as exc:
            if not retryable(exc) or attempt == ATTEMPTS:
                raise FetchError(
                    f"{what}: {_words(exc)}" + (f" (after {attempt} attempts)" if attempt > 1 else "")
                ) from exc
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def _words(exc: Exception) -> str:
    """The error's first line, as the server or the library put it."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def backoff_s() -> float:
    return float(os.environ.get("OVERLAP_FETCH_BACKOFF_S") or 1.0)


def file_digest(path: Path, digest) -> str:
    """`digest` (a hashlib object, maybe already fed a header) over the file's bytes, as hex."""
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    return file_digest(path, hashlib.sha256())


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file (a hub file outside LFS is checked against it)."""
    return file_digest(path, hashlib.sha1(f"blob {path.stat().st_size}\0".encode()))


def extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], into: Path) -> None:
    """Unpack with no absolute paths, no path or link out of `into`, no devices: tarfile's `data` filter where
    Python has it (3.11.4+; Debian bookworm's 3.11.2, the images' Python, does not), else the same checks here."""
    if hasattr(tarfile, "data_filter"):
        try:
            tar.extractall(into, members=members, filter="data")
        except tarfile.FilterError as exc:
            raise FetchError(f"{exc.tarinfo.name}: leaves the model folder or is not a plain file ({exc})") from exc
        return
    root = into.resolve()
    for member in members:
        target = (root / member.name).resolve()
        link = (target.parent / member.linkname).resolve() if member.issym() else (
            (root / member.linkname).resolve() if member.islnk() else target)  # fmt: skip
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise FetchError(f"{member.name}: a device or FIFO in a model archive")
        if not (target.is_relative_to(root) and link.is_relative_to(root)):
            raise FetchError(f"{member.name}: leaves the model folder")
        member.mode = (member.mode | 0o600) & 0o755 if member.isfile() else member.mode  # no setuid, as `data` does
    tar.extractall(into, members=members)


def flatten_single_folder(into: Path) -> None:
    """An archive of `NAME/...` unpacks to the model folder itself, not a folder holding it."""
    entries = [p for p in into.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and not (into / "config.json").exists():
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(into / child.name)
        inner.rmdir()
