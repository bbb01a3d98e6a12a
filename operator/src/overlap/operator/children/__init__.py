"""The objects an InferenceService owns, built as plain dicts by pure functions (no Kubernetes calls).

Every builder takes the service's name, namespace and defaulted spec (see `spec.with_defaults`) and returns one
manifest. `build_children` returns them all, each with an owner reference to the InferenceService, so that
deleting the service deletes them (Kubernetes' garbage collector) and the operator sees edits to them.

The ConfigMap, the PodDisruptionBudget and the ServiceMonitor are built here; the rest, one module each:
`services` (the Services, and which of them the public one routes to), `proxies` (the activator's and the router's
Deployments) and `deployment` (the engine pods' Deployment), which assembles `containers`, `volumes`, `probes` and
`pod` (the pod contract and template); `common` holds the metadata and security contexts they share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.engine.config import EngineConfig
from overlap.operator import adapters
from overlap.operator import spec as specs
from overlap.operator.children.common import metadata
from overlap.operator.children.deployment import build_deployment
from overlap.operator.children.pod import API_KEY_ENV, SOCKET
from overlap.operator.children.probes import DEFAULT_STARTUP_S
from overlap.operator.children.proxies import build_activator, build_router
from overlap.operator.children.services import (
    at_zero,
    build_pods_service,
    build_replicas_service,
    build_service,
    has_activator,
    routed,
    service_url,
)
from overlap.operator.identity import INSTANCE_LABEL, configmap_name, owner_reference, selector_labels

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_STARTUP_S",
    "SERVICE_LABEL_META",
    "SOCKET",
    "adopt",
    "at_zero",
    "build_activator",
    "build_adapters_configmap",
    "build_children",
    "build_configmap",
    "build_deployment",
    "build_pdb",
    "build_pods_service",
    "build_replicas_service",
    "build_router",
    "build_service",
    "build_servicemonitor",
    "has_activator",
    "routed",
    "service_url",
]

# Prometheus' name for the scraped Service's INSTANCE_LABEL (a label name's "." and "/" become "_").
SERVICE_LABEL_META = "__meta_kubernetes_service_label_" + INSTANCE_LABEL.replace(".", "_").replace("/", "_")


def build_configmap(name: str, namespace: str, config: EngineConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(configmap_name(name), namespace, name),
        "data": {"engine.json": specs.engine_json(config)},
    }


def build_adapters_configmap(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter list the pods' adapters container watches (adapters.py): apart from engine.json, which the control
    loop writes too."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(adapters.configmap_name(name), namespace, name),
        "data": {"adapters.json": adapters.list_json(spec)},
    }


def build_pdb(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(name, namespace, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def build_servicemonitor(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    meta = metadata(name, namespace, name)
    meta["labels"] = {**(spec["prometheus"]["serviceMonitor"].get("labels") or {}), **meta["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            # A routed service has two such Services (the router's and the pods'): both scrapes are labelled with the
            # InferenceService's name, which the control loop's queries select by, not with their Service's.
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": spec["prometheus"]["serviceMonitor"]["interval"],
                    "relabelings": [
                        {"sourceLabels": [SERVICE_LABEL_META], "targetLabel": "service", "action": "replace"}
                    ],
                }
            ],
        },
    }


def build_children(
    owner: Mapping[str, Any], spec: Mapping[str, Any], config: EngineConfig, *, with_servicemonitor: bool
) -> list[dict[str, Any]]:
    """Every child the operator keeps in line with the spec (the admin tokens are admin_tokens.py's)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    children = [build_configmap(name, namespace, config)]
    if spec.get("adapters"):
        children.append(build_adapters_configmap(name, namespace, spec))
    # the Service a proxy forwards to before the proxy: its pod may resolve the name when it starts
    if has_activator(spec):
        children += [build_pods_service(name, namespace, spec), build_activator(name, namespace, spec)]
    if routed(spec):
        children += [build_replicas_service(name, namespace, spec), build_router(name, namespace, spec)]
    # The Service before the Deployment: scaled to zero, requests go to the activator before the pods go.
    ready = (owner.get("status") or {}).get("readyReplicas") or 0
    children += [
        build_service(name, namespace, spec, to_activator=at_zero(spec, ready)),
        build_deployment(name, namespace, spec, config),
        build_pdb(name, namespace),
    ]
    if with_servicemonitor and spec["prometheus"]["serviceMonitor"]["enabled"]:
        children.append(build_servicemonitor(name, namespace, spec))
    return [adopt(child, owner) for child in children]


def adopt(child: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    child["metadata"]["ownerReferences"] = [owner_reference(owner)]
    return child
