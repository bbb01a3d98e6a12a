"""Who the operator's objects are: the InferenceService's API coordinates, the labels and names of its children, and
the owner references that tie them to it. Every module that reads or writes them takes them from here."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

GROUP = "overlap.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
CR = (GROUP, VERSION, PLURAL)
MANAGED_BY = "overlap-operator"
INSTANCE_LABEL = "overlap.dev/inferenceservice"
RESTART_HASH_ANNOTATION = "overlap.dev/engine-restart-hash"
ADMIN_TOKENS_SECRET = "overlap-admin-tokens"  # one per namespace, a key per service (admin_tokens.py)
# The label every child carries: the operator's watches select by it.
OWNED = {"app.kubernetes.io/managed-by": MANAGED_BY}


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "overlap", INSTANCE_LABEL: name}


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "inference-server",
        **OWNED,
    }


def activator_labels(name: str) -> dict[str, str]:
    """The activator's pods: not the engine pods' selector, so neither Deployment claims the other's pods."""
    return {"app.kubernetes.io/name": "overlap-activator", INSTANCE_LABEL: name}


def router_labels(name: str) -> dict[str, str]:
    """The router's pods (routing.mode prefix): like the activator's, apart from the engine pods."""
    return {"app.kubernetes.io/name": "overlap-router", INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """The pods' label selector in the string form `status.selector` (and /scale) uses."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name).items()))


# A Service's name is a DNS-1035 label: at most 63 characters.
DNS_LABEL_MAX = 63


def pods_service_name(name: str) -> str:
    """The engine pods' own Service, where the scale-from-zero activator forwards. A service name of up to 63
    characters leaves no room for the suffix, so a long one is cut and a hash of the whole name keeps two such
    names apart."""
    return _with_suffix(name, "pods")


def replicas_service_name(name: str) -> str:
    """The headless Service of the engine pods (routing.mode prefix): its DNS name's addresses are the ready pods,
    the replicas the router picks from."""
    return _with_suffix(name, "replicas")


def _with_suffix(name: str, suffix: str) -> str:
    plain = f"{name}-{suffix}"
    if len(plain) <= DNS_LABEL_MAX:
        return plain
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: DNS_LABEL_MAX - len(suffix) - len(digest) - 2]}-{digest}-{suffix}"


def activator_name(name: str) -> str:
    return f"{name}-activator"


def router_name(name: str) -> str:
    return f"{name}-router"


def configmap_name(name: str) -> str:
    return f"{name}-engine"


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
