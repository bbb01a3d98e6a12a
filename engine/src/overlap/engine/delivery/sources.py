"""Where models come from: the Hugging Face hub (huggingface_hub), S3 and GCS buckets (MinIO's S3 client; GCS
through its S3-compatible XML API), http(s) archives (httpx2, the HTTP client huggingface_hub uses) and OCI
registries (ORAS's Python client).

Each source resolves what the uri names now (a hub commit, a bucket listing, an archive's hash) into a cache key,
then writes the model folder into a partial folder, resuming what an earlier attempt left there, and checks every
file against the source's own hash."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from overlap.engine.delivery.uri import ModelURI

# What a model folder needs from a hub repository: config, tokenizer, chat template and safetensors weights at the
# top level (no other weight formats, no `original/` copies).
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")
S3_ENDPOINT = "https://s3.amazonaws.com"
GCS_ENDPOINT = "https://storage.googleapis.com"  # GCS's S3-compatible XML API (HMAC keys)
ATTEMPTS = 5  # per file: a 5xx, a dropped connection or a stall is retried, with backoff
T = TypeVar("T")


class FetchError(RuntimeError):
    """A fetch that cannot succeed (or did not within its attempts); the message is the source's own words."""


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


# ---- the hub ---------------------------------------------------------------------------------------------------
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
                raise _Mismatch(f"{name}: {kind} {got} does not match the hub's {expected}")

        with_retries(f"{self.uri}: {name}", attempt, _hub_retryable, backoff_s())


class _Mismatch(Exception):
    """A file whose hash is not the source's: fetched again, then an error."""


def _hub_retryable(exc: Exception) -> bool:
    import httpx2 as httpx
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):  # (an OSError too: the status decides)
        response = getattr(exc, "response", None)
        return response is not None and (response.status_code >= 500 or response.status_code == 429)
    return isinstance(exc, _Mismatch | httpx.TransportError | OSError)


# ---- buckets ---------------------------------------------------------------------------------------------------
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
                raise _Truncated(f"{relative}: {partial.stat().st_size} of {size} bytes")
            if "-" not in etag and len(etag) == 32:  # a single-part upload's ETag is its MD5
                md5 = file_digest(partial, hashlib.md5(usedforsecurity=False))
                if md5 != etag:
                    partial.unlink()
                    raise _Mismatch(f"{relative}: MD5 {md5} does not match the ETag {etag}")
            os.rename(partial, target)

        with_retries(f"{self.uri}: {relative}", attempt, _bucket_retryable, backoff_s())


def _bucket_retryable(exc: Exception) -> bool:
    import urllib3
    from minio.error import ServerError

    return isinstance(exc, _Mismatch | _Truncated | ServerError | urllib3.exceptions.HTTPError | OSError)


# ---- http(s) archives ------------------------------------------------------------------------------------------
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
                raise _Truncated(f"{archive.stat().st_size} of {self.size} bytes")
            if self.uri.sha256 and (got := file_sha256(archive)) != self.uri.sha256:
                archive.unlink()
                raise _Mismatch(f"sha256 {got} does not match the uri's {self.uri.sha256}")

        with_retries(str(self.uri), attempt, _http_retryable, backoff_s())
        with tarfile.open(archive) as tar:
            _extract(tar, tar.getmembers(), into)
        archive.unlink()
        _flatten_single_folder(into)


class _Truncated(Exception):
    """The body ended before Content-Length: resumed at the next attempt."""


def _http_retryable(exc: Exception) -> bool:
    import httpx2 as httpx

    if isinstance(exc, _Mismatch | _Truncated | httpx.TransportError | OSError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return False


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], into: Path) -> None:
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


def _flatten_single_folder(into: Path) -> None:
    """An archive of `NAME/...` unpacks to the model folder itself, not a folder holding it."""
    entries = [p for p in into.iterdir()]
    if len(entries) == 1 and entries[0].is_dir() and not (into / "config.json").exists():
        inner = entries[0]
        for child in inner.iterdir():
            child.rename(into / child.name)
        inner.rmdir()


# ---- OCI registries --------------------------------------------------------------------------------------------
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
TAR_MODES = {"tar": "r:", "tar+gzip": "r:gz", "tar.gzip": "r:gz"}  # a layer media type's suffix -> tarfile's mode
TITLE = "org.opencontainers.image.title"  # ORAS: the layer is a file of this name...
UNPACK = "io.deis.oras.content.unpack"  # ...or, with this "true", a folder of this name, as a tar


class ImageSource:
    """A model image in an OCI registry, through ORAS's client (the registry's token or basic auth, with
    credentials from DOCKER_CONFIG's config.json, as a `kubernetes.io/dockerconfigjson` Secret holds them).

    Two kinds of image: a ModelCar-style image (tar layers; the model is the folder `/models`, or the image's root
    when there is none), and an ORAS artifact (`oras push REF config.json model.safetensors ...`: a file per layer,
    named by its title annotation; or the model folder pushed whole, one tar layer). Every blob is
    fetched with Range requests that resume at the byte offset after a drop or a stall, and checked against its
    digest while it streams; the layers are then unpacked in order, whiteouts applied.
    OVERLAP_OCI_PLAIN_HTTP lists registries (HOST or HOST:PORT, comma-separated) spoken to over plain HTTP."""

    def __init__(self, uri: ModelURI, *, stall_s: float) -> None:
        import requests.adapters
        from oras.container import Container
        from oras.provider import Registry

        self.uri = uri
        self.container = Container(f"{uri.location}:{uri.revision or 'latest'}")
        plain = {host.strip() for host in os.environ.get("OVERLAP_OCI_PLAIN_HTTP", "").split(",") if host.strip()}
        registry = self.container.registry
        self.registry = Registry(insecure=registry in plain or registry.rsplit(":", 1)[0] in plain)

        class StallTimeout(requests.adapters.HTTPAdapter):  # requests has no session-wide timeout
            def send(self, request, **kwargs):
                kwargs["timeout"] = kwargs.get("timeout") or stall_s
                return super().send(request, **kwargs)

        for prefix in ("http://", "https://"):
            self.registry.session.mount(prefix, StallTimeout())
        docker_config = Path(os.environ.get("DOCKER_CONFIG") or "~/.docker").expanduser() / "config.json"
        self.registry.auth.load_configs(self.container, configs=[str(docker_config)] if docker_config.exists() else [])
        self.manifest: dict = {}

    def _get(self, url_path: str, headers: dict | None = None):
        """One authenticated request (ORAS answers the registry's 401 with a token or basic auth). ORAS's own
        retry loop is skipped: with_retries decides what is retried and for how long."""
        from oras.provider import Registry

        response = Registry.do_request.__wrapped__(
            self.registry, f"{self.registry.prefix}://{url_path}", "GET", headers=dict(headers or {}), stream=True
        )
        if response.status_code >= 400:
            response.close()
            response.raise_for_status()
        return response

    def resolve(self) -> tuple[str, int | None]:
        digest = f"sha256:{self.uri.sha256}" if self.uri.sha256 else None
        reference = digest or self.container.tag
        manifest, digest = with_retries(str(self.uri), lambda: self._manifest(reference, digest), _oci_retryable,
                                        backoff_s())  # fmt: skip
        if "manifests" in manifest:  # an image index (or Docker manifest list): one manifest per platform
            chosen = _platform_manifest(manifest.get("manifests") or [])
            if chosen is None:
                raise FetchError(f"{self.uri}: the image index has no linux/amd64 (or platform-free) manifest")
            manifest, digest = with_retries(str(self.uri), lambda: self._manifest(chosen, chosen), _oci_retryable,
                                            backoff_s())  # fmt: skip
        self.manifest = manifest
        layers = manifest.get("layers") or []
        if not layers:
            raise FetchError(f"{self.uri}: the manifest {digest} has no layers")
        for layer in layers:
            if not _is_file(layer) and _tar_mode(layer) is None:
                raise FetchError(f"{self.uri}: layer {layer.get('digest')} is {layer.get('mediaType')}: neither a "
                                 f"tar layer (tar, tar+gzip; not tar+zstd) nor a file named by an {TITLE} "
                                 "annotation")  # fmt: skip
        total = sum(int(layer.get("size") or 0) for layer in layers)
        return f"oci/{self.uri.location.replace(':', '_')}/{digest.replace(':', '-')}", total

    def _manifest(self, reference: str, expected: str | None) -> tuple[dict, str]:
        url = self.container.manifest_url(reference)
        with self._get(url, {"Accept": ", ".join(MANIFEST_TYPES)}) as response:
            body = response.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if expected and digest != expected:
            raise _Mismatch(f"the manifest's sha256 is {digest}, not {expected}")
        return json.loads(body), digest

    def download(self, into: Path) -> None:
        blobs = into / ".blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        layers = self.manifest["layers"]
        with ThreadPoolExecutor(4) as pool:
            for future in [pool.submit(self._blob, blobs, layer) for layer in layers]:
                future.result()
        rootfs = into / ".rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        rootfs.mkdir()
        for index, layer in enumerate(layers):
            blob = blobs / layer["digest"].replace(":", "-")
            if _is_file(layer):
                name = Path(layer["annotations"][TITLE])
                if name.is_absolute() or ".." in name.parts:
                    raise FetchError(f"{self.uri}: layer title {name} leaves the model folder")
                (rootfs / name).parent.mkdir(parents=True, exist_ok=True)
                used_again = any(later["digest"] == layer["digest"] for later in layers[index + 1 :])
                (shutil.copyfile if used_again else os.replace)(blob, rootfs / name)  # a file's blob is moved
            else:
                _unpack_layer(blob, _tar_mode(layer), rootfs)
        model = rootfs / "models" if (rootfs / "models").is_dir() else rootfs
        for child in model.iterdir():
            os.replace(child, into / child.name)
        shutil.rmtree(rootfs)
        shutil.rmtree(blobs)
        _flatten_single_folder(into)  # a folder pushed whole with ORAS

    def _blob(self, blobs: Path, layer: dict) -> None:
        digest, size = layer["digest"], int(layer.get("size") or 0)
        algorithm, _, expected = digest.partition(":")
        if algorithm != "sha256":
            raise FetchError(f"{self.uri}: layer digest {digest}: only sha256 digests are checked")
        target = blobs / digest.replace(":", "-")
        if target.is_file():
            return
        partial = target.with_name(target.name + ".incomplete")

        def attempt() -> None:
            done = partial.stat().st_size if partial.exists() else 0
            hasher = hashlib.sha256()
            if done:
                file_digest(partial, hasher)  # the bytes an earlier attempt kept, then the rest as it streams
            if done < size:
                headers = {"Range": f"bytes={done}-"} if done else {}
                with self._get(self.container.get_blob_url(digest), headers) as response:
                    if done and response.status_code != 206:  # the registry ignored the Range: start over
                        done, hasher = 0, hashlib.sha256()
                    with partial.open("ab" if done else "wb") as handle:
                        for chunk in response.iter_content(1 << 20):
                            handle.write(chunk)
                            hasher.update(chunk)
            got = partial.stat().st_size
            if got != size:
                raise _Truncated(f"{digest}: {got} of {size} bytes")
            if hasher.hexdigest() != expected:
                partial.unlink()
                raise _Mismatch(f"layer {digest}: its bytes hash to sha256:{hasher.hexdigest()}")
            os.rename(partial, target)

        with_retries(f"{self.uri}: layer {digest[:19]}", attempt, _oci_retryable, backoff_s())


def _platform_manifest(manifests: list[dict]) -> str | None:
    """The digest of an index's linux/amd64 manifest, or of one that names no platform (an artifact's)."""
    for entry in manifests:
        platform = entry.get("platform") or {}
        if platform.get("os", "linux") == "linux" and platform.get("architecture", "amd64") == "amd64":
            return entry["digest"]
    return None


def _is_file(layer: dict) -> bool:
    annotations = layer.get("annotations") or {}
    return TITLE in annotations and annotations.get(UNPACK) != "true"


def _tar_mode(layer: dict) -> str | None:
    """tarfile's read mode for a tar layer's media type, None for one that is not a tar (or is zstd)."""
    media = layer.get("mediaType", "")
    return next((mode for suffix, mode in TAR_MODES.items() if media.endswith(suffix)), None)


def _unpack_layer(blob: Path, mode: str, rootfs: Path) -> None:
    """One image layer over the ones below it: its whiteouts delete (`.wh.NAME`) or empty (`.wh..wh..opq`) what
    they name, then its files land (tarfile's data filter: no absolute paths, no links out of the root)."""
    with tarfile.open(blob, mode) as tar:
        members = []
        for member in tar.getmembers():
            path = Path(member.name)
            if path.name == ".wh..wh..opq":
                folder = rootfs / path.parent
                for child in folder.iterdir() if folder.is_dir() else []:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            elif path.name.startswith(".wh."):
                gone = rootfs / path.parent / path.name[len(".wh.") :]
                if gone.is_dir() and not gone.is_symlink():
                    shutil.rmtree(gone)
                else:
                    gone.unlink(missing_ok=True)
            else:
                members.append(member)
        _extract(tar, members, rootfs)


def _oci_retryable(exc: Exception) -> bool:
    import requests

    if isinstance(exc, requests.HTTPError):
        return exc.response is not None and (exc.response.status_code >= 500 or exc.response.status_code == 429)
    return isinstance(exc, _Mismatch | _Truncated | requests.RequestException | OSError)
