"""The Services, and which of them the public one routes to: the router of a routed service, else the engine pods,
or the activator while a service that scales to zero has none ready."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.operator import spec as specs
from overlap.operator.children.common import metadata
from overlap.operator.identity import (
    INSTANCE_LABEL,
    OWNED,
    activator_labels,
    pods_service_name,
    replicas_service_name,
    router_labels,
    selector_labels,
)


def routed(spec: Mapping[str, Any]) -> bool:
    """routing.mode prefix: the Service points at `overlap router`, which picks a pod per request."""
    return spec["routing"]["mode"] == "prefix"


def has_activator(spec: Mapping[str, Any]) -> bool:
    """minReplicas 0 with a loop that scales, and no router: the service gets an activator to hold requests while
    at zero (a routed service's router holds them itself)."""
    auto = spec["autoscaling"]
    return auto["minReplicas"] == 0 and auto["mode"] in specs.SCALING_MODES and not routed(spec)


def at_zero(spec: Mapping[str, Any], ready: int) -> bool:
    """Whether the Service should route to the activator: no replica asked for, or none of them (`ready`) ready.
    Asked for 0, the switch comes before the pods go, so requests during their drain reach the activator, which
    forwards them to the pods while they still serve."""
    return has_activator(spec) and (spec["replicas"] == 0 or ready == 0)


def service_url(name: str, namespace: str, spec: Mapping[str, Any]) -> str:
    return f"http://{name}.{namespace}.svc:{spec['sidecar']['port']}"


def http_service(metadata: dict[str, Any], selector: dict[str, str], port: int) -> dict[str, Any]:
    """A ClusterIP Service with the one public port (the admin port is never on a Service)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_service(name: str, namespace: str, spec: Mapping[str, Any], to_activator: bool = False) -> dict[str, Any]:
    """The public API only: to the router of a routed service, else to the pods (the activator at zero)."""
    if routed(spec):
        selector = router_labels(name)
    else:
        selector = activator_labels(name) if to_activator else selector_labels(name)
    return http_service(metadata(name, namespace, name), selector, spec["sidecar"]["port"])


def build_replicas_service(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine pods as the router finds them: headless, so its DNS name answers with each ready pod's address.
    It carries the service's labels, so the ServiceMonitor scrapes the pods through it (and the router through
    the public Service)."""
    service = http_service(metadata(replicas_service_name(name), namespace, name), selector_labels(name),
                           spec["sidecar"]["port"])  # fmt: skip
    # Ready pods only: publishNotReadyAddresses keeps its default, false, which the API server leaves out of what it
    # returns, so writing it here would make the Service differ from what is stored at every resync.
    service["spec"]["clusterIP"] = "None"
    return service


def build_pods_service(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine pods whatever the public Service routes to: where the activator forwards. Its labels leave out
    the selector labels, so a ServiceMonitor (which selects Services by them) does not scrape the pods twice."""
    meta = metadata(pods_service_name(name), namespace, name)
    meta["labels"] = {INSTANCE_LABEL: name, **OWNED}
    return http_service(meta, selector_labels(name), spec["sidecar"]["port"])
