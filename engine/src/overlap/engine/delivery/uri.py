"""`spec.model.uri`: where a model comes from, parsed once (the operator and `overlap model fetch` share it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("hf", "s3", "gs", "https", "http", "oci", "pvc")
_HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# An image reference with its registry named: HOST[:PORT]/REPOSITORY[:TAG][@sha256:DIGEST] (the distribution spec's
# grammar, lower-case repository components, tags of up to 128 characters).
_IMAGE = re.compile(
    r"^(?P<registry>(?:[a-zA-Z0-9-]+\.)*[a-zA-Z0-9-]+(?::\d+)?)"
    r"/(?P<repository>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@sha256:(?P<digest>[0-9a-f]{64}))?$"
)


class ModelURIError(ValueError):
    """The uri cannot name a model; the message says which part and why."""


@dataclass(frozen=True)
class ModelURI:
    """A parsed `model.uri`. `location`: the hub repository, the bucket, the claim, or the URL without its
    fragment, or the image's REGISTRY/REPOSITORY; `path`: the prefix or path inside it; `revision`: the hub revision
    asked for (a branch, tag or commit), or the image's tag; `sha256`: an https archive's expected hash
    (`#sha256=HEX`), or the image manifest's digest."""

    scheme: str
    location: str
    path: str = ""
    revision: str | None = None
    sha256: str | None = None
    text: str = ""

    @property
    def fetched(self) -> bool:
        """Whether a pod fetches it into the cache (a claim is mounted instead)."""
        return self.scheme != "pvc"

    def __str__(self) -> str:
        return self.text


def parse(text: str) -> ModelURI:
    """`hf://ORG/NAME[@REVISION]`, `s3://BUCKET/PREFIX`, `gs://BUCKET/PREFIX`, `https://HOST/PATH.tar[.gz]`
    (optionally `#sha256=HEX`), `oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]`, `pvc://CLAIM/PATH`;
    ModelURIError otherwise."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ModelURIError(f"{text!r}: the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if not _HUB_REPO.match(repo):
            raise ModelURIError(f"{text!r}: expected hf://ORG/NAME[@REVISION], e.g. hf://Qwen/Qwen2.5-0.5B-Instruct")
        if "@" in rest and not revision:
            raise ModelURIError(f"{text!r}: an empty revision after '@'")
        return ModelURI("hf", repo, revision=revision or None, text=text)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise ModelURIError(f"{text!r}: {bucket!r} is not a bucket name")
        return ModelURI(scheme, bucket, prefix.strip("/"), text=text)
    if scheme == "oci":
        image = _IMAGE.match(rest)
        if not image:
            raise ModelURIError(
                f"{text!r}: expected oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST] with the registry named, "
                "e.g. oci://ghcr.io/acme/qwen2.5-0.5b:v1"
            )
        tag = image["tag"] or (None if image["digest"] else "latest")
        return ModelURI("oci", f"{image['registry']}/{image['repository']}", revision=tag, sha256=image["digest"],
                        text=text)  # fmt: skip
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not _CLAIM.match(claim):
            raise ModelURIError(f"{text!r}: {claim!r} is not a PersistentVolumeClaim name")
        return ModelURI("pvc", claim, path.strip("/"), text=text)
    parts = urlsplit(text)
    if not parts.netloc:
        raise ModelURIError(f"{text!r}: no host")
    if not re.search(r"\.(tar|tar\.gz|tgz)$", parts.path):
        raise ModelURIError(f"{text!r}: an http(s) model is an archive (.tar, .tar.gz or .tgz) of the model folder")
    sha256 = None
    if parts.fragment:
        key, _, value = parts.fragment.partition("=")
        if key != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ModelURIError(f"{text!r}: the fragment must be #sha256=<64 hex digits>")
        sha256 = value
    return ModelURI(scheme, parts._replace(fragment="").geturl(), sha256=sha256, text=text)
