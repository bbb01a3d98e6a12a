"""The model's part of the pod: the volume the weights are read from and, for a fetched `model.uri`, the cache
volume and the init container that fetches into it (`overlap model fetch`, from the engine image); an oci:// model
with `imageVolume` is an image volume that kubelet pulls, once per node. A draft_model's draft
(engine.speculative.model) is fetched by the same init container, after the model, into the same cache.

A fetched model is read through a link the fetch leaves in an emptyDir (the cache folder's name holds the resolved
revision, which the operator does not know); every pod that sees the cache (the node's, or a shared claim) finds a
model fetched before and fetches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from overlap.operator import spec as specs

FETCH_CONTAINER = "fetch"
FETCH_RESOURCES = {"cpu": "1", "memory": "2Gi"}


@dataclass
class ModelParts:
    volumes: list[dict[str, Any]] = field(default_factory=list)
    engine_mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    pull_secrets: list[str] = field(default_factory=list)  # the pod's imagePullSecrets, for an image volume
    containers: list[dict[str, Any]] = field(default_factory=list)  # beside the engine's (the adapters')


def model_parts(spec: Mapping[str, Any], security: Mapping[str, Any]) -> ModelParts:
    """What the defaulted spec's model, and a draft_model's draft, need in the pod; `security` is the containers'
    securityContext. One `fetch` init container fetches both, the model first (ModelReady reads its state; a
    failure's reason says which of the two failed)."""
    draft = specs.draft_uri(spec)
    model = spec["model"]
    uri = specs.model_uri(model)
    if uri is not None and specs.model_fetched(model):
        return fetch_parts(spec, security, uri.text, draft.text if draft else None, uri.scheme)
    parts = unfetched_parts(model)
    if draft is None:
        return parts
    fetch = fetch_parts(spec, security, None, draft.text, draft.scheme)  # the model read in place, its draft fetched
    return ModelParts([*parts.volumes, *fetch.volumes], [*parts.engine_mounts, *fetch.engine_mounts],
                      fetch.init_containers, parts.pull_secrets)  # fmt: skip


def unfetched_parts(model: Mapping[str, Any]) -> ModelParts:
    """A model read where it is: in the image, a claim, a node folder, or an oci:// image volume."""
    uri = specs.model_uri(model)
    if uri is None:
        if model["source"] == "pvc":
            volume = {"name": "model", "persistentVolumeClaim": {"claimName": model["claimName"], "readOnly": True}}
        elif model["source"] == "hostPath":
            volume = {"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}}
        else:
            return ModelParts()  # baked into the image
        return ModelParts([volume], [{"name": "model", "mountPath": model["mountPath"], "readOnly": True}])
    if not uri.fetched:  # pvc://CLAIM/PATH
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": uri.location, "readOnly": True}}
        return ModelParts([volume], [{"name": "model", "mountPath": model["mountPath"], "readOnly": True}])
    # oci:// as an image volume
    secret = (model.get("secretRef") or {}).get("name")
    reference = uri.location + (f":{uri.revision}" if uri.revision else "") + (
        f"@sha256:{uri.sha256}" if uri.sha256 else "")  # fmt: skip
    volume = {"name": "model", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}
    mount = {"name": "model", "mountPath": specs.MODEL_IMAGE_DIR, "readOnly": True}
    return ModelParts([volume], [mount], pull_secrets=[secret] if secret else [])


def fetch_args(spec: Mapping[str, Any]) -> list[str] | None:
    """The fetch init container's args for the defaulted spec (what it fetches, and how); None without one."""
    containers = model_parts(spec, {}).init_containers
    return next((c["args"] for c in containers if c["name"] == FETCH_CONTAINER), None)


def fetch_parts(spec: Mapping[str, Any], security: Mapping[str, Any], uri: str | None, draft: str | None,
                scheme: str) -> ModelParts:  # fmt: skip
    """The fetch init container (`overlap model fetch` of the model's `uri`, its `draft`, or both), the cache and
    link volumes, and the engine's mounts of them. model.secretRef is read as a `scheme` fetch reads it (the model's,
    or the draft's when the model is not fetched): a registry login for oci://, the environment otherwise."""
    model = spec["model"]
    cache = model.get("cache") or {}
    cache_volume, fetch_security = cache_parts(model, security)
    args = ["model", "fetch", *([uri] if uri else []), "--cache-dir", specs.MODEL_CACHE_DIR]
    if uri:
        args += ["--link", specs.MODEL_LINK]
    if draft:
        args += ["--draft", draft, "--draft-link", specs.DRAFT_LINK]
    if cache.get("maxSizeGi"):
        args += ["--max-cache-gb", f"{cache['maxSizeGi'] * 2**30 / 1e9:.3f}"]
    fetch = {
        "name": FETCH_CONTAINER,
        "image": spec["images"]["engine"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "command": ["overlap"],
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": dict(FETCH_RESOURCES), "limits": dict(FETCH_RESOURCES)},
        "securityContext": fetch_security,
        # `overlap model fetch` writes a failure's reason there; the log's tail if it died before it could.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "model-cache", "mountPath": specs.MODEL_CACHE_DIR},
            {"name": "model-link", "mountPath": specs.MODEL_LINK_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes = [cache_volume, {"name": "model-link", "emptyDir": {}}]
    secret = (model.get("secretRef") or {}).get("name")
    if secret and scheme == "oci":  # a kubernetes.io/dockerconfigjson Secret, read as a registry client reads it
        items = [{"key": ".dockerconfigjson", "path": "config.json"}]
        volumes.append({"name": "registry-config", "secret": {"secretName": secret, "items": items}})
        fetch["volumeMounts"].append({"name": "registry-config", "mountPath": specs.REGISTRY_CONFIG_DIR,
                                      "readOnly": True})  # fmt: skip
        fetch["env"].append({"name": "DOCKER_CONFIG", "value": specs.REGISTRY_CONFIG_DIR})
    elif secret:
        fetch["envFrom"] = [{"secretRef": {"name": secret}}]
    mounts = [
        {"name": "model-cache", "mountPath": specs.MODEL_CACHE_DIR, "readOnly": True},
        {"name": "model-link", "mountPath": specs.MODEL_LINK_DIR, "readOnly": True},
    ]
    return ModelParts(volumes, mounts, [fetch])


def cache_parts(model: Mapping[str, Any], security: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model cache's volume (model.cache: a shared claim or a node folder), and the securityContext of a
    container that fetches into it."""
    cache = model.get("cache") or {}
    if cache.get("claimName"):
        volume = {"name": "model-cache", "persistentVolumeClaim": {"claimName": cache["claimName"]}}
        return volume, dict(security)  # the pod's fsGroup makes the claim writable
    path = cache.get("hostPath") or specs.DEFAULT_MODEL_CACHE_HOSTPATH
    volume = {"name": "model-cache", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    # kubelet creates the node folder as root (0755) and fsGroup never reaches a hostPath: the fetch runs as root
    # there, with no capabilities; what it writes stays readable by the engine's user.
    return volume, {**security, "runAsUser": 0, "runAsNonRoot": False}
