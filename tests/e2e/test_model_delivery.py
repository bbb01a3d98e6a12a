"""`model.uri` on podman pods (`make e2e`): the fetch init container takes the model from a loopback hub into the
node's cache, the engine serves it, and a second replica on the node starts from the cache with 0 bytes fetched; a
repository the hub does not have fails the fetch, and ModelReady says so in the hub's words. A model image (built
with buildah, the model under /models) is fetched from a real registry, and mounted as an image volume."""

from __future__ import annotations

import datetime
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import NAMESPACE, Cluster, wait_for
from tests.support.hub_node import hub_node, model_files, service_yaml
from tests.support.model_sources import RegistryServer
from tests.support.node_agent import NodeAgent
from tests.support.sidecar import http

pytestmark = pytest.mark.e2e
REPORT = Path("e2e-report") / "model-delivery.md"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[dict]:
    with hub_node(tmp_path_factory.mktemp("delivery"), {"acme/tiny": model_files(tiny_model_dir)}) as node:
        yield {**node, "model_dir": tiny_model_dir}


def _service(name: str, uri: str, node: dict, replicas: int = 1, **model) -> str:
    return service_yaml(name, uri, node, replicas, model)


def _condition(cluster: Cluster, name: str, kind: str) -> dict:
    conditions = (cluster.service(name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _seconds(start: str, end: str) -> float:
    parse = lambda text: datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def test_the_first_pod_fetches_and_a_second_starts_from_the_nodes_cache(node):
    cluster, agent, hub = node["cluster"], node["agent"], node["hub"]
    size = sum(len(data) for data in hub.repos["acme/tiny"].values())
    cluster.apply("-f", "-", stdin=_service("fetched", "hf://acme/tiny", node))
    try:
        first_asked = time.monotonic()
        wait_for(lambda: cluster.service("fetched").get("status", {}).get("readyReplicas") == 1, 240,
                 "the first pod to fetch and serve", interval=1)  # fmt: skip
        first_s = time.monotonic() - first_asked
        fetched_once = hub.sent
        assert fetched_once >= size  # every file went over the wire once
        ready = wait_for(lambda: (c := _condition(cluster, "fetched", "ModelReady")).get("status") == "True" and c,
                         30, "ModelReady")  # fmt: skip
        assert ready["reason"] == "Fetched"
        host, port = agent.service_address("fetched")
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
        status, _, reply = http("POST", f"http://{host}:{port}/v1/completions", body, timeout=60)
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply

        cluster.kubectl("patch", "oisvc", "fetched", "--type=merge", "-p", '{"spec":{"replicas":2}}')
        second_asked = time.monotonic()
        wait_for(lambda: cluster.service("fetched").get("status", {}).get("readyReplicas") == 2, 240,
                 "the second pod to start from the cache", interval=1)  # fmt: skip
        second_s = time.monotonic() - second_asked
        assert hub.sent == fetched_once  # 0 bytes for the second replica
        pods = [p for p in agent.pods.values() if p.deployment == "fetched" and not p.terminating]
        logs = [agent.container_log(p.name, "fetch") for p in pods]
        assert sum("nothing to fetch" in log for log in logs) == 1, logs
        fetch_s = {}
        for pod in cluster.core.list_namespaced_pod(
            NAMESPACE, label_selector="overlap.dev/inferenceservice=fetched"
        ).items:
            done = pod.status.init_container_statuses[0].state.terminated
            fetch_s[pod.metadata.name] = _seconds(done.started_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                                  done.finished_at.strftime("%Y-%m-%dT%H:%M:%SZ"))  # fmt: skip
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.write_text(
            "| replica | asked to ready (s) | bytes from the hub |\n|---|---|---|\n"
            f"| first (fetches {size / 1e6:.0f} MB) | {first_s:.1f} | {fetched_once} |\n"
            f"| second (from the node's cache) | {second_s:.1f} | {hub.sent - fetched_once} |\n\n"
            f"fetch init containers, started to finished (s, whole seconds): {json.dumps(fetch_s)}\n"
        )
    finally:
        cluster.kubectl("delete", "inferenceservice", "fetched")


def test_a_repository_the_hub_does_not_have_is_a_fetch_failure_in_the_hubs_words(node):
    cluster = node["cluster"]
    cluster.apply("-f", "-", stdin=_service("missing", "hf://acme/missing", node))
    try:
        failed = wait_for(lambda: (c := _condition(cluster, "missing", "ModelReady")).get("reason") == "FetchFailed"
                          and c, 120, "ModelReady FetchFailed", interval=1)  # fmt: skip
        assert failed["status"] == "False" and "hf://acme/missing" in failed["message"] and "404" in failed["message"]
        ready = _condition(cluster, "missing", "Ready")
        assert ready["status"] == "False" and "init container fetch" in ready["message"], ready
    finally:
        cluster.kubectl("delete", "inferenceservice", "missing")


MODEL_IMAGE = "localhost/overlap-e2e-model-tiny:1"


def _model_image(model_dir: Path, registry: RegistryServer) -> str:
    """A ModelCar-style image of the tiny model (FROM scratch, the model under /models), built with buildah into
    the node's image storage and pushed to the registry; its name there."""
    container = subprocess.run(["buildah", "from", "scratch"], check=True, capture_output=True, text=True).stdout
    try:
        subprocess.run(["buildah", "copy", "--quiet", container.strip(), str(model_dir), "/models/"], check=True,
                       capture_output=True)  # fmt: skip
        subprocess.run(["buildah", "commit", "--quiet", container.strip(), MODEL_IMAGE], check=True,
                       capture_output=True)  # fmt: skip
    finally:
        subprocess.run(["buildah", "rm", container.strip()], capture_output=True)
    pushed = f"{registry.host}/models/tiny:1"
    subprocess.run(["buildah", "push", "--quiet", "--tls-verify=false", MODEL_IMAGE, f"docker://{pushed}"],
                   check=True, capture_output=True)  # fmt: skip
    return pushed


def _serves(agent: NodeAgent, name: str) -> None:
    host, port = agent.service_address(name)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
    status, _, reply = http("POST", f"http://{host}:{port}/v1/completions", body, timeout=60)
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply


def test_a_model_image_is_fetched_from_a_registry_or_mounted_as_an_image_volume(node):
    cluster, agent = node["cluster"], node["agent"]
    pushed = _model_image(node["model_dir"], node["registry"])
    cluster.apply("-f", "-", stdin=_service("from-registry", f"oci://{pushed}", node))
    cluster.apply("-f", "-", stdin=_service("image-volume", f"oci://{MODEL_IMAGE}", node,
                                            imageVolume=True))  # fmt: skip
    try:
        for name in ("from-registry", "image-volume"):
            wait_for(lambda: cluster.service(name).get("status", {}).get("readyReplicas") == 1, 240,  # noqa: B023
                     f"{name} to serve", interval=1)  # fmt: skip
            _serves(agent, name)
        assert _condition(cluster, "from-registry", "ModelReady")["reason"] == "Fetched"
        pod = next(p for p in agent.pods.values() if p.deployment == "from-registry" and not p.terminating)
        assert "fetched 0.11 GB" in agent.container_log(pod.name, "fetch")
        mounted = next(p for p in agent.pods.values() if p.deployment == "image-volume" and not p.terminating)
        assert mounted.image_volumes == {"model": MODEL_IMAGE}
        assert "initContainers" not in mounted.template["spec"]
    finally:
        cluster.kubectl("delete", "inferenceservice", "from-registry", "image-volume")
