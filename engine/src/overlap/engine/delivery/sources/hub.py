"""Models from the Hugging Face hub (hf://ORG/NAME[@REVISION]), through huggingface_hub."""

from __future__ import annotations

import fnmatch
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from overlap.engine.delivery.sources.common import (
    FetchError,
    Mismatch,
    backoff_s,
    file_sha256,
    git_blob_sha1,
    with_retries,
)
from overlap.engine.delivery.uri import ModelURI

# What a model folder needs from a hub repository: config, tokenizer, chat template and safetensors weights at the
# top level (no other weight formats, no `original/` copies).
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")


class HubSource:
    """A hub repository at a revision, through huggingface_hub (HF_ENDPOINT, HF_TOKEN as it reads them): the
    revision resolved to its commit, the files fetched in parallel (huggingface_hub resumes a file from its byte
    offset after a drop or a stall), each checked against the hub's sha256 (LFS) or git blob id."""

    def __init__(self, uri: ModelURI, *, token: str | None, stall_s: float) -> None:
        from huggingface_hub import HfApi, constants

        constants.HF_HUB_DOWNLOAD_TIMEOUT = max(1, round(stall_s))  # a read that waits this long is a stall
        # huggingface_hub joins the network's reads into 10 MiB chunks, a copy per read: 1 MiB chunks cost far less
        constants.DOWNLOAD_CHUNK_SIZE = 1 << 20
        self.uri, self.token = uri, token or os.environ.get("HF_TOKEN")
        self.endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT  # read now, not when the hub was imported
        self.api = HfApi(endpoint=self.endpoint, token=self.token)
        self.commit: str | None = None
        self.files: list[tuple[str, int | None, str | None, str | None]] = []  # name, size, sha256, blob id

    def resolve(self) -> tuple[str, int | None]:
        info = with_retries(
            str(self.uri),
            lambda: self.api.model_info(self.uri.location, revision=self.uri.revision, files_metadata=True),
            _hub_retryable,
            backoff_s(),
        )
        self.commit = info.sha
        for sibling in info.siblings or []:
            name = sibling.rfilename
            if "/" in name or not any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILES):
                continue
            sha256 = sibling.lfs.sha256 if sibling.lfs else None
            self.files.append((name, sibling.size, sha256, sibling.blob_id))
        if not any(name.endswith(".safetensors") for name, *_ in self.files):
            raise FetchError(f"{self.uri}: the repository at {info.sha} has no .safetensors weights")
        total = sum(size or 0 for _, size, _, _ in self.files)
        return f"hf/{self.uri.location.replace('/', '--')}/{info.sha}", total

    def download(self, into: Path) -> None:
        with ThreadPoolExecutor(8) as pool:
            for future in [
                pool.submit(self._one, into, name, sha256, blob_id) for name, _, sha256, blob_id in self.files
            ]:
                future.result()
        shutil.rmtree(into / ".cache", ignore_errors=True)  # huggingface_hub's download bookkeeping

    def _one(self, into: Path, name: str, sha256: str | None, blob_id: str | None) -> None:
        from huggingface_hub import hf_hub_download

        def attempt() -> None:
            path = Path(hf_hub_download(self.uri.location, name, revision=self.commit, local_dir=into,
                                        token=self.token, endpoint=self.endpoint))  # fmt: skip
            kind, expected, got = ("sha256", sha256, file_sha256(path)) if sha256 else (
                "git blob id", blob_id, git_blob_sha1(path))  # fmt: skip
            if expected and got != expected:
                path.unlink()
                raise Mismatch(f"{name}: {kind} {got} does not match the hub's {expected}")

        with_retries(f"{self.uri}: {name}", attempt, _hub_retryable, backoff_s())


def _hub_retryable(exc: Exception) -> bool:
    import httpx2 as httpx
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):  # (an OSError too: the status decides)
        response = getattr(exc, "response", None)
        return response is not None and (response.status_code >= 500 or response.status_code == 429)
    return isinstance(exc, Mismatch | httpx.TransportError | OSError)
