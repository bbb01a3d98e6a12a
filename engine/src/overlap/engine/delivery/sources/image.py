"""Models as images in OCI registries (oci://REGISTRY/REPO[:TAG][@sha256:HEX]), through ORAS's client."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from overlap.engine.delivery.sources.common import (
    FetchError,
    Mismatch,
    Truncated,
    backoff_s,
    extract,
    file_digest,
    flatten_single_folder,
    with_retries,
)
from overlap.engine.delivery.uri import ModelURI

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
            raise Mismatch(f"the manifest's sha256 is {digest}, not {expected}")
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
        flatten_single_folder(into)  # a folder pushed whole with ORAS

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
                raise Truncated(f"{digest}: {got} of {size} bytes")
            if hasher.hexdigest() != expected:
                partial.unlink()
                raise Mismatch(f"layer {digest}: its bytes hash to sha256:{hasher.hexdigest()}")
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
        extract(tar, members, rootfs)


def _oci_retryable(exc: Exception) -> bool:
    import requests

    if isinstance(exc, requests.HTTPError):
        return exc.response is not None and (exc.response.status_code >= 500 or exc.response.status_code == 429)
    return isinstance(exc, Mismatch | Truncated | requests.RequestException | OSError)
