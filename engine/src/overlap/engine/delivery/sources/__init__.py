"""Where models come from: the Hugging Face hub (huggingface_hub), S3 and GCS buckets (MinIO's S3 client; GCS
through its S3-compatible XML API), http(s) archives (httpx2, the HTTP client huggingface_hub uses) and OCI
registries (ORAS's Python client).

Each source resolves what the uri names now (a hub commit, a bucket listing, an archive's hash) into a cache key,
then writes the model folder into a partial folder, resuming what an earlier attempt left there, and checks every
file against the source's own hash.

Each kind of source is a module here: `hub` (hf://), `bucket` (s3://, gs://), `archive` (http(s)://) and `image`
(oci://); `common` holds what they share."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from overlap.engine.delivery.sources.archive import ArchiveSource
from overlap.engine.delivery.sources.bucket import BucketSource
from overlap.engine.delivery.sources.common import FetchError
from overlap.engine.delivery.sources.hub import HubSource
from overlap.engine.delivery.sources.image import ImageSource
from overlap.engine.delivery.uri import ModelURI

__all__ = ["ArchiveSource", "BucketSource", "FetchError", "HubSource", "ImageSource", "Source", "source_for"]


class Source(Protocol):
    def resolve(self) -> tuple[str, int | None]:
        """(cache key, total bytes if known) of what the uri names now."""
        ...

    def download(self, into: Path) -> None:
        """Write the model folder into `into` (resuming what is there), every file checked."""
        ...


def source_for(uri: ModelURI, *, token: str | None = None, stall_s: float = 30.0) -> Source:
    if uri.scheme == "hf":
        return HubSource(uri, token=token, stall_s=stall_s)
    if uri.scheme in ("s3", "gs"):
        return BucketSource(uri, stall_s=stall_s)
    if uri.scheme in ("http", "https"):
        return ArchiveSource(uri, stall_s=stall_s)
    if uri.scheme == "oci":
        return ImageSource(uri, stall_s=stall_s)
    raise FetchError(f"{uri}: a {uri.scheme}:// model is mounted, not fetched")
