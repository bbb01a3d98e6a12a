"""spec.adapters, the LoRA adapters served on the model: the checks the CRD's rules make (again, for a server that
skipped them), and the adapters' part of the pod and its children.

What is in the pod does not depend on which adapters are listed, only on whether any is: the list goes into a
ConfigMap of its own (`NAME-adapters`, mounted whole so that kubelet brings its changes to the running pod), which
the pod's `adapters` container watches (`overlap model fetch-adapters --watch`: the model's fetch path, cache and
hashes). A change of the list therefore never rolls the Deployment; the operator loads and unloads the adapters in
the running pods through their API (adapter_sync.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from overlap.engine.delivery.adapters import link_name
from overlap.engine.delivery.uri import ModelURIError
from overlap.engine.delivery.uri import parse as parse_uri
from overlap.operator import spec as specs
from overlap.operator.model_volumes import ModelParts, cache_parts

CONTAINER = "adapters"
LIST_DIR = "/etc/overlap-adapters"
LIST_FILE = f"{LIST_DIR}/adapters.json"
LINK_DIR = "/var/run/overlap-adapters"  # an emptyDir: one link per adapter into the cache
RESOURCES = {"cpu": "500m", "memory": "1Gi"}  # a download and its hashes; it waits, most of its life


def listed(spec: Mapping[str, Any]) -> dict[str, str]:
    """{name: uri} of spec.adapters, in the spec's order."""
    return {adapter["name"]: adapter["uri"] for adapter in spec.get("adapters") or []}


def paths(spec: Mapping[str, Any]) -> dict[str, str]:
    """{name: the folder the engine loads it from} (the adapters container's link)."""
    return {name: f"{LINK_DIR}/{link_name(name, uri)}" for name, uri in listed(spec).items()}


def check(spec: Mapping[str, Any]) -> None:
    """The CRD's rules on spec.adapters, in its words; and the one it cannot state (the operator's reach)."""
    names = [adapter.get("name") for adapter in spec.get("adapters") or []]
    if len(set(names)) != len(names):
        raise specs.SpecError("adapter names must be unique")
    if spec["model"].get("servedName") in names:
        raise specs.SpecError("an adapter's name must differ from model.servedName (clients pick the adapter by it)")
    for adapter in spec.get("adapters") or []:
        if {".", ".."} & set(str(adapter.get("uri", "")).split("/")):
            raise specs.SpecError("an adapter's uri must not hold '.' or '..' segments")
        try:
            uri = parse_uri(str(adapter.get("uri", "")))
        except ModelURIError as exc:
            raise specs.SpecError(f"adapter {adapter.get('name')}: uri {exc}") from exc
        if not uri.fetched:
            raise specs.SpecError(f"adapter {adapter['name']}: a pvc:// uri cannot be fetched; use a fetched scheme")


def configmap_name(name: str) -> str:
    return f"{name}-adapters"


def list_json(spec: Mapping[str, Any]) -> str:
    """The ConfigMap's adapters.json, which the adapters container reads: {name: uri}, stable order."""
    return json.dumps(listed(spec), indent=2, sort_keys=True) + "\n"


def pod_parts(name: str, spec: Mapping[str, Any], security: Mapping[str, Any], model: ModelParts) -> ModelParts:
    """`model`'s pod parts plus, when spec.adapters lists any, the adapters' (the cache, if the model brought none,
    the links and the list, the adapters container); `security` is the containers' securityContext."""
    if not spec.get("adapters"):
        return model
    cache, fetch_security = cache_parts(spec["model"], security)
    has_cache = any(volume["name"] == "model-cache" for volume in model.volumes)
    volumes = [
        *model.volumes,
        *([] if has_cache else [cache]),
        {"name": "adapter-links", "emptyDir": {}},
        {"name": "adapter-list", "configMap": {"name": configmap_name(name)}},
    ]
    engine_mounts = [
        *model.engine_mounts,
        *([] if has_cache else [{"name": "model-cache", "mountPath": specs.MODEL_CACHE_DIR, "readOnly": True}]),
        {"name": "adapter-links", "mountPath": LINK_DIR, "readOnly": True},
    ]
    container = {
        "name": CONTAINER,
        "image": spec["images"]["engine"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "command": ["overlap"],
        "args": [
            "model",
            "fetch-adapters",
            LIST_FILE,
            "--watch",
            "--cache-dir",
            specs.MODEL_CACHE_DIR,
            "--link-dir",
            LINK_DIR,
        ],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "resources": {"requests": dict(RESOURCES), "limits": dict(RESOURCES)},
        "securityContext": fetch_security,
        "volumeMounts": [
            {"name": "model-cache", "mountPath": specs.MODEL_CACHE_DIR},
            {"name": "adapter-links", "mountPath": LINK_DIR},
            {"name": "adapter-list", "mountPath": LIST_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    # model.secretRef as the model's fetch takes it: an oci:// model's is a registry login, any other's environment
    secret = (spec["model"].get("secretRef") or {}).get("name")
    uri = specs.model_uri(spec["model"])
    if secret and uri is not None and uri.scheme == "oci":
        if not any(volume["name"] == "registry-config" for volume in volumes):
            items = [{"key": ".dockerconfigjson", "path": "config.json"}]
            volumes.append({"name": "registry-config", "secret": {"secretName": secret, "items": items}})
        container["volumeMounts"].append({"name": "registry-config", "mountPath": specs.REGISTRY_CONFIG_DIR,
                                          "readOnly": True})  # fmt: skip
        container["env"].append({"name": "DOCKER_CONFIG", "value": specs.REGISTRY_CONFIG_DIR})
    elif secret:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return ModelParts(volumes, engine_mounts, model.init_containers, model.pull_secrets, [*model.containers, container])
