"""Models as .tar / .tar.gz archives over http(s) (https://HOST/PATH[#sha256=HEX]), through httpx2."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

from overlap.engine.delivery.sources.common import (
    Mismatch,
    Truncated,
    backoff_s,
    extract,
    file_sha256,
    flatten_single_folder,
    with_retries,
)
from overlap.engine.delivery.uri import ModelURI


class ArchiveSource:
    """A .tar / .tar.gz of the model folder over http(s) (httpx): fetched with Range requests that resume at the
    byte offset after a drop or a stall, checked against `#sha256=` when the uri has one, then unpacked."""

    def __init__(self, uri: ModelURI, *, stall_s: float) -> None:
        import httpx2 as httpx

        self.uri = uri
        self.client = httpx.Client(timeout=httpx.Timeout(stall_s), follow_redirects=True)
        self.size: int | None = None

    def resolve(self) -> tuple[str, int | None]:
        def head():
            response = self.client.head(self.uri.location)
            response.raise_for_status()
            return response

        response = with_retries(str(self.uri), head, _http_retryable, backoff_s())
        length = response.headers.get("Content-Length")
        self.size = int(length) if length else None
        version = (
            self.uri.sha256
            or hashlib.sha256(
                (response.headers.get("ETag") or response.headers.get("Last-Modified") or "").encode()
            ).hexdigest()
        )
        where = hashlib.sha256(self.uri.location.encode()).hexdigest()[:16]
        return f"{self.uri.scheme}/{where}/{version[:16]}", self.size

    def download(self, into: Path) -> None:
        archive = into / ".archive.incomplete"
        into.mkdir(parents=True, exist_ok=True)

        def attempt() -> None:
            done = archive.stat().st_size if archive.exists() else 0
            if self.size is None or done < self.size:
                headers = {"Range": f"bytes={done}-"} if done else {}
                with self.client.stream("GET", self.uri.location, headers=headers) as response:
                    response.raise_for_status()
                    mode = "ab" if done and response.status_code == 206 else "wb"
                    with archive.open(mode) as handle:
                        for chunk in response.iter_bytes(1 << 20):
                            handle.write(chunk)
            if self.size is not None and archive.stat().st_size != self.size:
                raise Truncated(f"{archive.stat().st_size} of {self.size} bytes")
            if self.uri.sha256 and (got := file_sha256(archive)) != self.uri.sha256:
                archive.unlink()
                raise Mismatch(f"sha256 {got} does not match the uri's {self.uri.sha256}")

        with_retries(str(self.uri), attempt, _http_retryable, backoff_s())
        with tarfile.open(archive) as tar:
            extract(tar, tar.getmembers(), into)
        archive.unlink()
        flatten_single_folder(into)


def _http_retryable(exc: Exception) -> bool:
    import httpx2 as httpx

    if isinstance(exc, Mismatch | Truncated | httpx.TransportError | OSError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return False
