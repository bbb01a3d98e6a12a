"""Pods that fail as they fail on a cluster, run by the node agent on podman (`make e2e`; needs `make images`):
a missing image, a container that exits, a pod that never becomes ready. Each shows in the Pod's and the
Deployment's status as kubelet and the Deployment controller would write it, and the operator's Ready condition
says why. The agent leaves no container behind, and a new agent removes what a killed one left. Three pods behind
the router (routing.mode prefix) lose no request when one of them is deleted under load, or when the router's own
pod is."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
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
from tests.support.sidecar import free_port, http, metric_value

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
    "inferenceservice-fp8.yaml": ("Ready", "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"),
    "inferenceservice-gpt-oss-20b.yaml": (
        "Ready",
        "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu",
    ),
    "inferenceservice-hpa.yaml": ("Ready", "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"),
    "inferenceservice-lora.yaml": ("Ready", "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"),
    "inferenceservice-pvc-autoscaling.yaml": ("Ready", 'persistentvolumeclaim "model-weights" not found'),
    "inferenceservice-qwen3-moe.yaml": (
        "Ready",
        "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu",
    ),
    "inferenceservice-routed.yaml": ("Ready", "Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"),
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


class Load:
    """Clients sending completions one after another from `workers` threads until stopped: three groups of
    requests share a long prefix each. Every request's outcome is kept: an HTTP status, or "refused" when no
    server took the connection (nothing was accepted)."""

    def __init__(self, url: str, workers: int = 6) -> None:
        self.url = f"{url}/v1/completions"
        self.results: list[tuple[float, int | str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]
        self.prefixes = [" ".join(f"Group {g} rule {i}: answer plainly and cite the page." for i in range(12))
                         for g in range(3)]  # fmt: skip

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[tuple[float, int | str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        return self.results

    def count(self) -> int:
        return len(self.results)

    def _run(self, worker: int) -> None:
        i = 0
        while not self._stop.is_set():
            body = {"model": "tiny", "prompt": f"{self.prefixes[(worker + i) % 3]} Question {worker}.{i}?",
                    "max_tokens": 8}  # fmt: skip
            try:
                status, _, answer = http("POST", self.url, body, timeout=60)
                if status == 200 and not answer["choices"][0]["finish_reason"]:
                    status = "unfinished"
            except OSError:  # refused or reset before a response: not accepted; a client backs off a little
                status = "refused"
                time.sleep(0.1)
            self.results.append((time.monotonic(), status))
            i += 1


def _router_pod(agent: NodeAgent, name: str):
    return next((p for p in agent.pods.values() if p.deployment == f"{name}-router" and not p.terminating), None)


def test_three_pods_behind_the_router_lose_nothing_when_one_or_the_router_is_deleted(node, tiny_model_dir):
    """routing.mode prefix with 3 replicas: the Service reaches the router's pod, which finds the engine pods by the
    headless Service's name. Under load, an engine pod deleted (kubelet's drain: not ready, preStop, SIGTERM) loses
    no request and the router drops it; the router's pod deleted, requests the old router accepted finish and,
    once the new one is ready, every request is served again."""
    cluster, agent = node
    name = "routed"
    _apply(cluster, name, tiny_model_dir, replicas=3, routing={"mode": "prefix"}, sidecar={"gracePeriodSeconds": 5})
    try:
        host, port = agent.service_address(name)
        url = f"http://{host}:{port}"

        def ready_replicas() -> int:
            status, _, body = http("GET", f"{url}/readyz", timeout=5)
            return status == 200 and sum(r["ready"] for r in body["replicas"].values())

        wait_for(lambda: ready_replicas() == 3, 240, "the router to see 3 ready replicas", interval=1)
        load = Load(url).start()
        wait_for(lambda: load.count() >= 30, 60, "the load to start")
        doomed = next(p for p in agent.pods.values() if p.deployment == name and p.ready)
        cluster.core.delete_namespaced_pod(doomed.name, NAMESPACE)
        router = _router_pod(agent, name)
        wait_for(lambda: f"replica http://{doomed.ip}:8000 removed" in agent.container_log(router.name, None), 30,
                 "the router to drop the deleted pod", interval=0.5)  # fmt: skip
        wait_for(lambda: doomed.gone, 60, "the deleted pod to be gone", interval=0.5)
        deleted = load.count()
        wait_for(lambda: load.count() >= deleted + 30, 60, "more load after the pod went")
        results = load.stop()
        assert {status for _, status in results} == {200}, [r for r in results if r[1] != 200][:5]
        print(f"routing e2e: {len(results)} requests, all served, across the deletion of pod {doomed.name}")
        metrics = http("GET", f"{url}/metrics")[2]
        assert (metric_value(metrics, "overlap_router_picks_total", 'reason="prefix"') or 0) > 0
        assert (metric_value(metrics, "overlap_router_prefix_hit_tokens_total") or 0) > 0

        # The router's own pod: deleted under load; the Deployment's next one takes over.
        load = Load(url).start()
        wait_for(lambda: load.count() >= 20, 60, "the load to start again")
        cluster.core.delete_namespaced_pod(router.name, NAMESPACE)
        wait_for(lambda: (p := _router_pod(agent, name)) and p.name != router.name and p.ready, 120,
                 "a new router pod ready", interval=0.5)  # fmt: skip
        ready_again = time.monotonic()
        wait_for(lambda: sum(t > ready_again + 1 for t, _ in load.results) >= 40, 120, "load through the new router")
        results = load.stop()
        answered = [status for _, status in results if status != "refused"]
        assert set(answered) == {200}, [r for r in results if r[1] not in (200, "refused")][:5]
        late = [(round(t - ready_again, 2), status) for t, status in results if t > ready_again + 1]
        assert {status for _, status in late} == {200}, late
        refused = len(results) - len(answered)
        print(
            f"routing e2e: router restart: {len(answered)} requests accepted, all served; {refused} refused while no"
            f" router pod was ready; {len(late)} served after the new one was"
        )
    finally:
        cluster.kubectl("delete", "inferenceservice", name)
