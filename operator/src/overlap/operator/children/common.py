"""What every child shares: its metadata, and the security contexts of the pods and containers the operator runs."""

from __future__ import annotations

from typing import Any

from overlap.operator.identity import labels

RUN_AS_USER = 10001


def metadata(name: str, namespace: str, owner: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(owner), **extra}


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
