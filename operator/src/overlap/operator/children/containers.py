"""The engine pod's containers: the engine (it holds the GPU) and the sidecar (the HTTP API in front of it), each
given its volume mounts (volumes.py) and probes (probes.py); and spec.pod.env, added to every container of the pod."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.engine.config import EngineConfig
from overlap.operator import spec as specs
from overlap.operator.children.common import container_security
from overlap.operator.children.pod import (
    ADMIN_TOKEN_FILE,
    API_KEY_ENV,
    CONFIG_FILE,
    ENDPOINT_DRAIN_S,
    SIDECAR_ALIVE,
    SOCKET,
)


def engine_container(spec: Mapping[str, Any], config: EngineConfig, mounts: list[dict[str, Any]],
                     probes: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    resources, images = spec["resources"], spec["images"]
    grace = spec["sidecar"]["gracePeriodSeconds"]
    # Quantities as strings: that is how the API server returns them, so drift checks compare like with like.
    ranks = config.tensor_parallel_size  # resources.engine.cpu is each rank's; /dev/shm holds their collectives
    limits = {
        "cpu": specs.per_rank_cpu(resources["engine"]["cpu"], ranks),
        "memory": str(resources["engine"]["memory"]),
    }
    if resources["gpus"] > 0:
        limits[resources["gpuResourceName"]] = str(resources["gpus"])
    # vLLM's flag; the adapters themselves are loaded through the sidecar's API (adapter_sync.py), so that the pod
    # template stays the same when the list changes.
    lora = ["--enable-lora"] if spec.get("adapters") else []
    return {
        "name": "engine",
        "image": images["engine"],
        "imagePullPolicy": images["pullPolicy"],
        "command": ["overlap"],
        "args": ["engine", "--socket", SOCKET, "--config", CONFIG_FILE, *lora],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "OVERLAP_CACHE_DIR", "value": "/tmp/overlap-cache"},
            # OpenMP (torch, oneDNN) sizes its pool from the node's cores unless told: the container's CPU limit
            {"name": "OMP_NUM_THREADS", "value": str(config.num_threads or 1)},
        ],
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "securityContext": container_security(),
        "volumeMounts": mounts,
        # The engine outlives the sidecar's drain (in-flight requests still need it), and no longer: its preStop
        # waits for the sidecar's alive file to go, at most the endpoint drain plus the sidecar's grace period.
        "lifecycle": {"preStop": {"exec": {"command": wait_while_exists(SIDECAR_ALIVE, ENDPOINT_DRAIN_S + grace)}}},
        **probes,
    }


def sidecar_container(spec: Mapping[str, Any], mounts: list[dict[str, Any]],
                      probes: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    resources, images, sidecar = spec["resources"], spec["images"], spec["sidecar"]
    limits = {"cpu": str(resources["sidecar"]["cpu"]), "memory": str(resources["sidecar"]["memory"])}
    env = [{"name": "HOME", "value": "/tmp"}, *api_key_env(spec)]
    return {
        "name": "sidecar",
        "image": images["sidecar"],
        "imagePullPolicy": images["pullPolicy"],
        "command": ["overlap"],
        "args": sidecar_args(spec),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": sidecar["port"], "protocol": "TCP"},
            {"name": "admin", "containerPort": sidecar["adminPort"], "protocol": "TCP"},
        ],
        **probes,
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "securityContext": container_security(),
        "volumeMounts": mounts,
        # Let the endpoints controller take the pod out of the Service before SIGTERM starts the drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": ENDPOINT_DRAIN_S}}},
    }


def sidecar_args(spec: Mapping[str, Any]) -> list[str]:
    sidecar = spec["sidecar"]
    args = [
        "sidecar",
        "--engine-socket", SOCKET,
        "--port", str(sidecar["port"]),
        "--admin-port", str(sidecar["adminPort"]),
        "--admin-token-file", ADMIN_TOKEN_FILE,
        "--watch-config", CONFIG_FILE,
        "--served-model-name", spec["model"]["servedName"],
        "--max-queued-requests", str(sidecar["maxQueuedRequests"]),
        "--max-queued-tokens", str(sidecar["maxQueuedTokens"]),
        "--max-inflight", str(sidecar["maxInflight"]),
        "--request-timeout-s", str(sidecar["requestTimeoutSeconds"]),
        "--grace-period-s", str(sidecar["gracePeriodSeconds"]),
        "--alive-file", SIDECAR_ALIVE,
    ]  # fmt: skip
    return args + api_key_args(spec)


def api_key_env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The API key (sidecar.apiKeySecret) as the environment variable its holders read: the sidecar, which requires
    it on /v1/*, and the router and activator, which require it too and send it to the pods."""
    secret = spec["sidecar"].get("apiKeySecret")
    if not secret:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}}]


def api_key_args(spec: Mapping[str, Any]) -> list[str]:
    return ["--api-key-env", API_KEY_ENV] if spec["sidecar"].get("apiKeySecret") else []


def wait_while_exists(path: str, timeout_s: int) -> list[str]:
    """A preStop command (POSIX sh, in the engine image) that returns once `path` is gone, or after `timeout_s`."""
    polls = 10 * int(timeout_s)
    return ["sh", "-c", f"i=0; while [ -e {path} ] && [ $i -lt {polls} ]; do sleep 0.1; i=$((i + 1)); done"]


def add_env(containers: list[dict[str, Any]], env: list[dict[str, Any]]) -> None:
    """spec.pod.env into each of `containers` (in place)."""
    for container in containers:
        container["env"] = merged_env(container["env"], env)


def merged_env(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per name, the user's winning, in a stable order (ours first). An empty value is left out, as the API
    server leaves it out of what it returns (so the drift check sees no change)."""
    by_name = {item["name"]: item for item in ours}
    for item in theirs:
        entry = {"name": item["name"]}
        if item.get("valueFrom"):
            entry["valueFrom"] = item["valueFrom"]
        elif item.get("value"):
            entry["value"] = item["value"]
        by_name[item["name"]] = entry
    return list(by_name.values())
