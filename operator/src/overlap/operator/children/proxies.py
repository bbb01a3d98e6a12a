"""The activator's and the router's Deployments: one pod of the sidecar image each (no GPU) on the public port."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.operator.children.common import container_security, metadata, pod_security
from overlap.operator.children.containers import api_key_args, api_key_env
from overlap.operator.identity import (
    activator_labels,
    activator_name,
    pods_service_name,
    replicas_service_name,
    router_labels,
    router_name,
)


def build_activator(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`overlap activator` (the sidecar image, no GPU) on the public port, forwarding to the pods' Service."""
    port = spec["sidecar"]["port"]
    args = ["activator", "--upstream", f"http://{pods_service_name(name)}.{namespace}.svc:{port}", "--port", str(port),
            "--hold-timeout-s", str(spec["sidecar"]["requestTimeoutSeconds"])]  # fmt: skip
    # At zero replicas the public Service routes here, so its ServiceMonitor scrapes /metrics here too.
    return proxy_deployment(activator_name(name), namespace, name, spec, "activator", activator_labels(name), args,
                            health="/activator/healthz", metrics="/activator/metrics")  # fmt: skip


def build_router(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`overlap router` (the sidecar image, no GPU) on the public port, picking among the ready engine pods (the
    addresses of the headless replicas Service) by their cached prefixes and load; it holds requests while none is
    ready, which makes it the activator of a service that scales to zero."""
    port, routing = spec["sidecar"]["port"], spec["routing"]
    args = ["router", "--replicas-from", f"{replicas_service_name(name)}.{namespace}.svc:{port}", "--port", str(port),
            "--hold-timeout-s", str(spec["sidecar"]["requestTimeoutSeconds"]),
            "--session-header", routing["sessionHeader"]]  # fmt: skip
    router = proxy_deployment(router_name(name), namespace, name, spec, "router", router_labels(name), args,
                              health="/router/healthz", metrics="/metrics", memory="1Gi")  # fmt: skip
    router["spec"]["replicas"] = routing["routerReplicas"]
    return router


def proxy_deployment(deployment: str, namespace: str, owner: str, spec: Mapping[str, Any], component: str,
                     pod_labels: dict[str, str], args: list[str], *, health: str, metrics: str,
                     memory: str = "256Mi") -> dict[str, Any]:  # fmt: skip
    """One pod of the sidecar image running `overlap ARGS` on the public port: the activator or the router. Its
    health endpoint answers while it runs: it must take requests to hold them, ready replicas or not. With the pods'
    API key it requires the key of clients and sends it to the pods."""
    port = spec["sidecar"]["port"]
    meta = metadata(deployment, namespace, owner)
    meta["labels"] = {**meta["labels"], **pod_labels, "app.kubernetes.io/component": component}
    probe = {"httpGet": {"path": health, "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 5}
    container = {
        "name": component,
        "image": spec["images"]["sidecar"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "command": ["overlap"],
        "args": args + api_key_args(spec),
        "env": [{"name": "HOME", "value": "/tmp"}, *api_key_env(spec)],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": memory}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {
                    "labels": meta["labels"],
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(port),
                        "prometheus.io/path": metrics,
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security(),
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }
