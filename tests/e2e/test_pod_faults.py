"""Pods that fail as they fail on a cluster, run by the node agent on podman (`make e2e`; needs `make images`):
a missing image, a container that exits, a pod that never becomes ready. Each shows in the Pod's and the
Deployment's status as kubelet and the Deployment controller would write it, and the operator's Ready condition
says why. The agent leaves no container behind, and a new agent removes what a killed one left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.cluster import (
    CRD_FILE,
    NAMESPACE,
    REPO,
    ApiThread,
    Cluster,
    running_operator,
    wait_for,
    write_kubeconfig,
)
from tests.support.images import ENGINE_IMAGE, OPERATOR_IMAGE, require_images
from tests.support.node_agent import AGENT_LABEL, NodeAgent
from tests.support.ranks import rank_pids, stream_completions
from tests.support.sidecar import free_port, http

pytestmark = pytest.mark.e2e
HELM_TEST, HELM_TEST_PORT = "overlap-helm-test", free_port()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, NodeAgent]]:
    require_images()
    workdir = tmp_path_factory.mktemp("faults")
    api_thread = ApiThread()
    agent = None
    try:
        cluster = Cluster(api_thread, write_kubeconfig(workdir / "kubeconfig", api_thread.url, NAMESPACE))
        cluster.apply("-f", str(CRD_FILE))
        agent = NodeAgent(cluster.client, NAMESPACE, workdir / "node", proxy_ports={HELM_TEST: HELM_TEST_PORT}).start()
        with running_operator(cluster, workdir, "--namespace", NAMESPACE, "--standalone"):
            yield cluster, agent
    finally:
        if agent is not None:
            agent.stop()
        api_thread.close()
    left = subprocess.run(["podman", "ps", "--all", "--quiet", "--filter", f"label={AGENT_LABEL}={NAMESPACE}"],
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    assert not left, f"the node agent's stop() left containers behind: {left}"


def _apply(cluster: Cluster, name: str, model_dir: Path, **spec) -> None:
    body = {
        "apiVersion": "overlap.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "servedName": "tiny",
                "path": "/models/tiny",
                "source": "hostPath",
                "hostPath": str(model_dir),
                "mountPath": "/models/tiny",
            },
            "resources": {"gpus": 0, "engine": {"cpu": "1", "memory": "2Gi"}},
            "engine": {"simulatedDevice": {"fixedSeconds": 0.01, "perTokenSeconds": 0.0}},
            "sidecar": {"gracePeriodSeconds": 1},
            **spec,
        },
    }
    cluster.apply("-f", "-", stdin=yaml.safe_dump(body))


def _container_state(cluster: Cluster, name: str, container: str) -> dict:
    pods = cluster.core.list_namespaced_pod(NAMESPACE, label_selector=f"overlap.dev/inferenceservice={name}")
    for pod in pods.items:
        for status in pod.status.container_statuses or []:
            if status.name == container:
                return {"state": status.state.to_dict(), "restarts": status.restart_count, "pod": pod}
    return {}


def _ready_message(cluster: Cluster, name: str) -> str:
    for cond in (cluster.service(name).get("status") or {}).get("conditions") or []:
        if cond["type"] == "Ready":
            return cond["message"]
    return ""


def test_a_missing_image_is_err_image_pull_in_the_pod_deployment_and_service(node, tiny_model_dir):
    cluster, _ = node
    _apply(
        cluster, "no-image", tiny_model_dir, images={"engine": "localhost/overlap-missing:0", "sidecar": ENGINE_IMAGE}
    )
    state = wait_for(lambda: (s := _container_state(cluster, "no-image", "engine")) and s["state"]["waiting"], 60,
                     "the engine container waiting")  # fmt: skip
    assert state["reason"] == "ErrImagePull" and "localhost/overlap-missing:0" in state["message"]
    # The agent writes the Deployment's status after its pods' in each pass: wait for it, as a controller would.
    deployment = wait_for(lambda: (d := cluster.apps.read_namespaced_deployment_status("no-image", NAMESPACE).status)
                          and d.replicas == 1 and d, 30, "the Deployment's status")  # fmt: skip
    assert not deployment.ready_replicas
    assert [c.status for c in deployment.conditions if c.type == "Available"] == ["False"]
    message = wait_for(
        lambda: "ErrImagePull" in (text := _ready_message(cluster, "no-image")) and text,
        30,
        "the operator's Ready condition to say why",
    )
    assert message.startswith("0/1 replicas ready; pod no-image-")
    cluster.kubectl("delete", "inferenceservice", "no-image")


def test_a_container_that_exits_crash_loops_and_the_pod_never_becomes_ready(node, tiny_model_dir):
    cluster, agent = node
    empty = tiny_model_dir.parent / "not-a-model"
    empty.mkdir(exist_ok=True)
    empty.chmod(0o755)
    _apply(cluster, "no-model", empty)  # the engine exits: no config.json; the sidecar waits for it, unready
    state = wait_for(lambda: (s := _container_state(cluster, "no-model", "engine")) and s["restarts"] >= 1 and s, 90,
                     "the engine to exit and be restarted")  # fmt: skip
    pod = state["pod"]
    (engine,) = [c for c in pod.status.container_statuses if c.name == "engine"]
    assert engine.last_state.terminated.exit_code != 0
    ready = {c.type: c for c in pod.status.conditions}["Ready"]
    assert ready.status == "False" and "engine" in ready.message
    wait_for(lambda: "CrashLoopBackOff" in _ready_message(cluster, "no-model") or "exited with code" in
             _ready_message(cluster, "no-model"), 60, "the operator to report the crash loop")  # fmt: skip
    status = cluster.apps.read_namespaced_deployment_status("no-model", NAMESPACE).status
    assert status is not None and not status.ready_replicas
    assert any("no-model" in e and "exited with" in e for e in agent.events)
    cluster.kubectl("delete", "inferenceservice", "no-model")


def test_a_pod_on_two_cpu_ranks_serves_and_a_killed_rank_restarts_its_engine(node, tiny_model_dir):
    """engine.tensorParallelSize 2 on CPU: the engine container runs two rank processes (and gets the CPU of two);
    a rank killed mid-generation fails the requests in flight within 10 s, the engine exits 70, kubelet (the agent)
    restarts it and the pod serves again."""
    cluster, agent = node
    _apply(cluster, "ranks", tiny_model_dir,
           engine={"tensorParallelSize": 2, "maxNumSeqs": 8, "maxSeqLen": 512, "maxNumBatchedTokens": 256})  # fmt: skip
    try:
        wait_for(lambda: cluster.service("ranks").get("status", {}).get("readyReplicas") == 1, 180,
                 "the two-rank pod to serve", interval=1)  # fmt: skip
        pod = next(p for p in agent.pods.values() if p.deployment == "ranks" and not p.terminating)
        engine = next(c for c in pod.containers if c.name == "engine")
        assert engine.spec["resources"]["limits"]["cpu"] == "2"  # 1 CPU per rank
        main = int(agent.podman("inspect", "--format", "{{.State.Pid}}", engine.id))
        (rank,) = rank_pids(main)
        host, port = agent.service_address("ranks")

        async def kill_during_load() -> tuple[list[str], float]:
            load = asyncio.ensure_future(stream_completions(f"http://{host}:{port}", "tiny", 4))
            await asyncio.sleep(1.5)
            os.kill(rank, signal.SIGKILL)
            killed = time.monotonic()
            results = await load
            return results, time.monotonic() - killed

        results, answered_s = asyncio.run(kill_during_load())
        assert all(r not in ("finished", "cut") for r in results) and answered_s < 10, (results, answered_s)
        state = wait_for(lambda: (s := _container_state(cluster, "ranks", "engine")) and s["restarts"] >= 1 and s,
                         60, "the engine to exit and be restarted")  # fmt: skip
        (engine_status,) = [c for c in state["pod"].status.container_statuses if c.name == "engine"]
        assert engine_status.last_state.terminated.exit_code == 70  # the engine's word for a lost rank
        body = {"model": "tiny", "prompt": "again", "max_tokens": 4}
        wait_for(lambda: http("POST", f"http://{host}:{port}/v1/completions", body, timeout=30)[0] == 200, 120,
                 "the restarted engine to serve", interval=1)  # fmt: skip
    finally:
        cluster.kubectl("delete", "inferenceservice", "ranks")


def test_the_agent_leaves_nothing_behind_and_a_new_one_cleans_up_after_a_killed_one(node, tmp_path):
    cluster, _ = node
    labelled = ["podman", "ps", "--all", "--quiet", "--filter", f"label={AGENT_LABEL}=orphans"]
    # A second agent whose pods are "left behind": it stops syncing without stop(), as if killed.
    orphaning = NodeAgent(cluster.client, "orphans", tmp_path / "orphans")
    orphaning.podman("pod", "create", "--name", "orphan", "--label", f"{AGENT_LABEL}=orphans")
    orphaning.podman("create", "--pod", "orphan", "--label", f"{AGENT_LABEL}=orphans", OPERATOR_IMAGE, "--help")
    assert subprocess.run(labelled, capture_output=True, text=True).stdout.split()
    NodeAgent(cluster.client, "orphans", tmp_path / "next")  # its constructor removes them
    assert subprocess.run(["podman", "pod", "exists", "orphan"]).returncode == 1, "the orphaned pod is still there"
    assert not subprocess.run(labelled, capture_output=True, text=True).stdout.split()


def test_the_cpu_example_serves_as_written(node):
    """examples/inferenceservice-cpu.yaml unchanged: the real tiny model from the engine image, on CPU, in
    containers that run as uid 10001 on a read-only root with no capabilities and no privilege escalation."""
    cluster, agent = node
    cluster.apply("-f", str(REPO / "examples" / "inferenceservice-cpu.yaml"))
    try:
        wait_for(lambda: (cluster.service("tiny-cpu").get("status") or {}).get("readyReplicas") == 1, 120,
                 "the example's pod to be ready", interval=1)  # fmt: skip
        host, port = agent.service_address("tiny-cpu")
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8}
        status, _, reply = http("POST", f"http://{host}:{port}/v1/completions", body, timeout=60)
        assert status == 200 and reply["usage"]["completion_tokens"] == 8, reply
        # What the operator's template asks for, checked on the running containers themselves.
        (pod,) = [p for p in agent.pods.values() if p.deployment == "tiny-cpu" and p.ready]
        for container in pod.containers:
            assert agent.podman("exec", container.id, "id", "-u") == "10001", container.name
            touched = subprocess.run(["podman", "exec", container.id, "touch", "/opt/x"], capture_output=True,
                                     text=True, env=agent.podman.env)  # fmt: skip
            assert touched.returncode != 0 and "Read-only file system" in touched.stderr, container.name
            state = json.loads(agent.podman("inspect", "--format", "{{json .EffectiveCaps}}", container.id))
            assert not state, f"{container.name} keeps capabilities {state}"
            options = json.loads(agent.podman("inspect", "--format", "{{json .HostConfig.SecurityOpt}}", container.id))
            assert "no-new-privileges" in options, (container.name, options)
    finally:
        cluster.kubectl("delete", "inferenceservice", "tiny-cpu")


# Each example but the CPU one (served above) on this node, which has no GPU, no claim and no Prometheus: the
# condition of the service's status that must name what is missing, and the words it must use.
LACKING = {
    "inferenceservice.yaml": ("Ready", "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"),
    "inferenceservice-hpa.yaml": ("Ready", "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"),
    "inferenceservice-pvc-autoscaling.yaml": ("Ready", 'persistentvolumeclaim "model-weights" not found'),
    "inferenceservice-scale-to-zero.yaml": (
        "Scaling",
        "cannot query Prometheus at http://prometheus-operated.monitoring:9090",
    ),
}


def test_every_example_is_applied_by_a_test():
    examples = {path.name for path in (REPO / "examples").glob("*.yaml")}
    assert examples == {*LACKING, "inferenceservice-cpu.yaml"}


@pytest.mark.parametrize("example", sorted(LACKING))
def test_an_example_applied_as_written_names_what_the_node_lacks(node, example):
    """The example unchanged: its service is not Ready (the GPU it asks for, the claim, Prometheus are not here),
    and its status names the missing piece as the scheduler, kubelet or the control loop put it."""
    cluster, _ = node
    path = REPO / "examples" / example
    name = next(d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "InferenceService")["metadata"]["name"]
    kind, words = LACKING[example]
    cluster.apply("-f", str(path))
    try:

        def condition():
            conditions = (cluster.service(name).get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c["type"] == kind and words in c.get("message", "")), None)

        named = wait_for(condition, 90, f"{name}'s {kind} condition to say {words!r}", interval=1)
        ready = next(c for c in cluster.service(name)["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False", (named, ready)
    finally:
        cluster.kubectl("delete", "-f", str(path), "--wait=true")


def test_the_charts_helm_test_passes_against_a_running_operator(node):
    """The script `helm test` runs (charts/overlap/files/tests/serve-check.py), here with the cluster's kubeconfig
    and the Service's proxy in place of cluster DNS: a small service becomes Ready, serves, and is deleted."""
    cluster, _ = node
    script = REPO / "charts" / "overlap" / "files" / "tests" / "serve-check.py"
    done = subprocess.run(
        [sys.executable, str(script), NAMESPACE, "--timeout-s", "180", "--base-url", f"http://127.0.0.1:{HELM_TEST_PORT}"],
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Ready (AllReplicasReady" in done.stdout and "a completion of 4 tokens" in done.stdout
    wait_for(lambda: cluster.get("inferenceservice", HELM_TEST) is None, 30, "the test service deleted")
