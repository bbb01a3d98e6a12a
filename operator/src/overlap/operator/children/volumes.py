"""The engine pod's volumes, and where each of its containers mounts them (the model's come from model_volumes.py;
spec.pod's are added last)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.operator.children.pod import ADMIN_TOKEN_DIR, CONFIG_DIR, SOCKET_DIR
from overlap.operator.identity import ADMIN_TOKENS_SECRET, configmap_name
from overlap.operator.model_volumes import ModelParts


def pod_volumes(name: str, ranks: int, model: ModelParts, pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`ranks` tensor-parallel ranks hold their collectives in /dev/shm, a GiB each."""
    return [
        {"name": "socket", "emptyDir": {}},
        # A whole-folder ConfigMap mount (never subPath), so live-knob edits reach the running sidecar.
        {"name": "config", "configMap": {"name": configmap_name(name)}},
        {
            "name": "admin-token",
            "secret": {"secretName": ADMIN_TOKENS_SECRET, "items": [{"key": name, "path": "admin-token"}]},
        },
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{ranks}Gi"}},
        *model.volumes,
        *(pod.get("volumes") or []),
    ]


def engine_mounts(model: ModelParts, pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": "socket", "mountPath": SOCKET_DIR},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        *model.engine_mounts,
        *(pod.get("volumeMounts") or []),
    ]


def sidecar_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "socket", "mountPath": SOCKET_DIR},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
