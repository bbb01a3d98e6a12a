"""The engine pod: the contract its engine and sidecar containers share (docs/design.md, "The pod"), and the pod
template around them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.engine.config import EngineConfig
from overlap.operator import spec as specs
from overlap.operator.children.common import RUN_AS_USER, pod_security
from overlap.operator.identity import RESTART_HASH_ANNOTATION, labels
from overlap.operator.model_volumes import ModelParts

# The pod contract shared with the sidecar and engine commands.
SOCKET_DIR = "/run/overlap"
SOCKET = f"{SOCKET_DIR}/engine.sock"
SIDECAR_ALIVE = f"{SOCKET_DIR}/sidecar.alive"  # exists while the sidecar runs (its --alive-file)
CONFIG_DIR = "/etc/overlap"
CONFIG_FILE = f"{CONFIG_DIR}/engine.json"
ADMIN_TOKEN_DIR = "/var/run/secrets/overlap"
ADMIN_TOKEN_FILE = f"{ADMIN_TOKEN_DIR}/admin-token"
API_KEY_ENV = "OVERLAP_API_KEY"
# Seconds for the Service's endpoints to drop a terminating pod before the sidecar stops taking requests.
ENDPOINT_DRAIN_S = 5
GRACE_MARGIN_S = 10


def pod_template(name: str, spec: Mapping[str, Any], config: EngineConfig, containers: list[dict[str, Any]],
                 volumes: list[dict[str, Any]], model: ModelParts) -> dict[str, Any]:  # fmt: skip
    """The pod: its labels and annotations (the user's, then the operator's), and its spec."""
    sidecar, pod = spec["sidecar"], spec.get("pod") or {}
    return {
        "metadata": {
            "labels": {**(pod.get("labels") or {}), **labels(name)},
            "annotations": {
                **(pod.get("annotations") or {}),
                RESTART_HASH_ANNOTATION: specs.restart_hash(config),
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(sidecar["port"]),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec(spec, containers, volumes, model),
    }


def pod_spec(spec: Mapping[str, Any], containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
             model: ModelParts) -> dict[str, Any]:  # fmt: skip
    """The containers and volumes, the model's init containers and image pull secrets, and where the pod may run
    (spec.resources' scheduling fields, spec.pod's)."""
    resources, images, pod = spec["resources"], spec["images"], spec.get("pod") or {}
    grace = spec["sidecar"]["gracePeriodSeconds"]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": ENDPOINT_DRAIN_S + grace + GRACE_MARGIN_S,
        "securityContext": {**pod_security(), "fsGroup": RUN_AS_USER},  # the volumes the engine writes
        "containers": containers,
        "volumes": volumes,
    }
    if model.init_containers:
        pod_spec["initContainers"] = model.init_containers
    for key in ("nodeSelector", "tolerations", "affinity"):
        if resources.get(key):
            pod_spec[key] = resources[key]
    pull_secrets = list(dict.fromkeys([*(images.get("pullSecrets") or []), *model.pull_secrets]))
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in pull_secrets]
    for key in ("runtimeClassName", "priorityClassName", "serviceAccountName", "topologySpreadConstraints"):
        if pod.get(key):
            pod_spec[key] = pod[key]
    return pod_spec
