"""A node (the emulated API server, the node agent running podman pods, the operator) beside a loopback hub and
registry that the pods reach on the node's gateway: the e2e tests of model delivery and of LoRA adapters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.support.cluster import CRD_FILE, NAMESPACE, ApiThread, Cluster, running_operator, write_kubeconfig
from tests.support.images import require_images
from tests.support.model_sources import HubServer, RegistryServer
from tests.support.node_agent import NodeAgent


@contextlib.contextmanager
def hub_node(workdir: Path, repos: dict[str, dict[str, bytes]], *operator_args: str) -> Iterator[dict]:
    """{cluster, agent, hub, registry, cache}: `repos` on the hub, the node's model cache under `workdir`."""
    require_images()
    api_thread = ApiThread()
    agent = hub = registry = None
    try:
        cluster = Cluster(api_thread, write_kubeconfig(workdir / "kubeconfig", api_thread.url, NAMESPACE))
        cluster.apply("-f", str(CRD_FILE))
        agent = NodeAgent(cluster.client, NAMESPACE, workdir / "node").start()
        cluster.api.pod_logs = agent.container_log  # the API server asks the node for `pods/log`, as for kubelet
        hub = HubServer(repos, host=agent.gateway).start()  # where the pods reach the host
        registry = RegistryServer(workdir, host=agent.gateway)
        with running_operator(cluster, workdir, "--namespace", NAMESPACE, "--standalone", *operator_args):
            yield {"cluster": cluster, "agent": agent, "hub": hub, "registry": registry, "cache": workdir / "cache"}
    finally:
        if registry is not None:
            registry.stop()
        if hub is not None:
            hub.stop()
        if agent is not None:
            agent.stop()
        api_thread.close()


def model_files(folder: Path) -> dict[str, bytes]:
    """A folder's files, as a hub repository holds them."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def service_yaml(name: str, uri: str, node: dict, replicas: int = 1, model: dict | None = None, **spec) -> str:
    """An InferenceService of the tiny model from `uri`; its pods reach the loopback hub and registry on the node's
    gateway. `spec` adds fields (adapters, routing)."""
    full = {
        "model": {"servedName": "tiny", "uri": uri, "cache": {"hostPath": str(node["cache"])}, **(model or {})},
        "replicas": replicas,
        "resources": {"gpus": 0, "engine": {"cpu": "1", "memory": "2Gi"}},
        "engine": {"maxNumSeqs": 4, "maxSeqLen": 256, "maxNumBatchedTokens": 256},
        "sidecar": {"gracePeriodSeconds": 1},
        "pod": {
            "env": [
                {"name": "HF_ENDPOINT", "value": node["hub"].url},
                {"name": "OVERLAP_OCI_PLAIN_HTTP", "value": node["registry"].host},
            ]
        },
        **spec,
    }
    body = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": full}
    return yaml.safe_dump(body)
