"""The engine pods' Deployment, assembled from its parts: the containers (containers.py) with their mounts
(volumes.py) and probes (probes.py), the model's volumes and init container (model_volumes.py), and the pod around
them (pod.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.engine.config import EngineConfig
from overlap.operator import adapters
from overlap.operator.children import containers, probes, volumes
from overlap.operator.children.common import container_security, metadata
from overlap.operator.children.pod import pod_template
from overlap.operator.identity import selector_labels
from overlap.operator.model_volumes import model_parts

# How long a rollout may go without progress before the Deployment (and so the service) reports it stuck: a cold GPU
# pod pulls an image of several GB, maybe fetches its model, and loads it, which Kubernetes' default of 600 s does not
# cover. The time kubelet allows the engine to start (startupSeconds, its default included) plus this for the pull.
PULL_MARGIN_S = 600


def build_deployment(name: str, namespace: str, spec: Mapping[str, Any], config: EngineConfig) -> dict[str, Any]:
    """The engine pods: an engine and a sidecar container each (and the model's init container, if fetched; the
    adapters container, if spec.adapters lists any)."""
    pod = spec.get("pod") or {}
    startup_s = pod.get("startupSeconds") or probes.DEFAULT_STARTUP_S
    model = adapters.pod_parts(name, spec, container_security(), model_parts(spec, container_security()))
    engine_mounts, engine_probes = volumes.engine_mounts(model, pod), probes.engine_probes(startup_s)
    engine = containers.engine_container(spec, config, engine_mounts, engine_probes)
    sidecar = containers.sidecar_container(spec, volumes.sidecar_mounts(), probes.sidecar_probes())
    if pod.get("env"):
        containers.add_env([engine, sidecar, *model.containers, *model.init_containers], pod["env"])
    pod_volumes = volumes.pod_volumes(name, config.tensor_parallel_size, model, pod)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, namespace, name),
        "spec": {
            "replicas": spec["replicas"],
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": startup_s + PULL_MARGIN_S,
            "selector": {"matchLabels": selector_labels(name)},
            # By default a new pod comes up before an old one goes, one at a time (spec.rollout).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec["rollout"]["maxSurge"],
                    "maxUnavailable": spec["rollout"]["maxUnavailable"],
                },
            },
            "template": pod_template(name, spec, config, [engine, sidecar, *model.containers], pod_volumes, model),
        },
    }
