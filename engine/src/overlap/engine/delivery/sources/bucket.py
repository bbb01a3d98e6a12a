"""Models from S3 and GCS buckets (s3://BUCKET/PREFIX, gs://BUCKET/PREFIX), through MinIO's S3 client (GCS through
its S3-compatible XML API)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from overlap.engine.delivery.sources.common import (
    FetchError,
    Mismatch,
    Truncated,
    backoff_s,
    file_digest,
    with_retries,
)
from overlap.engine.delivery.uri import ModelURI

S3_ENDPOINT = "https://s3.amazonaws.com"
GCS_ENDPOINT = "https://storage.googleapis.com"  # GCS's S3-compatible XML API (HMAC keys)


class BucketSource:
    """Every object under an S3 (or GCS) prefix, through MinIO's S3 client: AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, else the pod's IAM role (IRSA or the instance's); AWS_ENDPOINT_URL
    for another S3-compatible store. Objects in parallel, each resumed at its byte offset after a drop or a stall,
    its size checked, and its MD5 where the ETag is one (a single-part upload)."""

    def __init__(self, uri: ModelURI, *, stall_s: float) -> None:
        import urllib3
        from minio import Minio
        from minio.credentials import ChainedProvider, EnvAWSProvider, IamAwsProvider

        endpoint = os.environ.get("AWS_ENDPOINT_URL") or (GCS_ENDPOINT if uri.scheme == "gs" else S3_ENDPOINT)
        parts = urlsplit(endpoint)
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=stall_s, read=stall_s),
            retries=urllib3.Retry(total=3, backoff_factor=0.5, status_forcelist=(500, 502, 503, 504)),
            maxsize=16,
        )
        credentials = ChainedProvider([EnvAWSProvider(), IamAwsProvider()])
        self.uri = uri
        self.client = Minio(parts.netloc, secure=parts.scheme == "https", region=os.environ.get("AWS_REGION"),
                            http_client=http, credentials=credentials)  # fmt: skip
        self.objects: list[tuple[str, int, str]] = []  # name, size, etag

    def resolve(self) -> tuple[str, int | None]:
        prefix = f"{self.uri.path}/" if self.uri.path else None

        def listing() -> list[tuple[str, int, str]]:
            found = self.client.list_objects(self.uri.location, prefix=prefix, recursive=True)
            return [(o.object_name, o.size, (o.etag or "").strip('"')) for o in found if not o.is_dir]

        self.objects = with_retries(str(self.uri), listing, _bucket_retryable, backoff_s())
        if not self.objects:
            raise FetchError(f"{self.uri}: no objects under this prefix")
        version = hashlib.sha256(json.dumps(sorted(self.objects)).encode()).hexdigest()[:16]
        key = f"{self.uri.scheme}/{self.uri.location}/{self.uri.path or '_'}/{version}"
        return key, sum(size for _, size, _ in self.objects)

    def download(self, into: Path) -> None:
        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(self._one, into, *o) for o in self.objects]:
                future.result()

    def _one(self, into: Path, name: str, size: int, etag: str) -> None:
        relative = name[len(self.uri.path) :].lstrip("/") if self.uri.path else name
        target = into / relative
        if target.is_file():
            return  # an earlier attempt finished it: a file is renamed into place only once checked
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".incomplete")

        def attempt() -> None:
            done = partial.stat().st_size if partial.exists() else 0
            if done < size:
                response = self.client.get_object(self.uri.location, name, offset=done)
                try:
                    with partial.open("ab") as handle:
                        for chunk in response.stream(1 << 20):
                            handle.write(chunk)
                finally:
                    response.close()
                    response.release_conn()
            if partial.stat().st_size != size:
                raise Truncated(f"{relative}: {partial.stat().st_size} of {size} bytes")
            if "-" not in etag and len(etag) == 32:  # a single-part upload's ETag is its MD5
                md5 = file_digest(partial, hashlib.md5(usedforsecurity=False))
                if md5 != etag:
                    partial.unlink()
                    raise Mismatch(f"{relative}: MD5 {md5} does not match the ETag {etag}")
            os.rename(partial, target)

        with_retries(f"{self.uri}: {relative}", attempt, _bucket_retryable, backoff_s())


def _bucket_retryable(exc: Exception) -> bool:
    import urllib3
    from minio.error import ServerError

    return isinstance(exc, Mismatch | Truncated | ServerError | urllib3.exceptions.HTTPError | OSError)
