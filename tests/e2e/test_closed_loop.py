"""The closed loop on real pods (`make e2e`; needs `make images`).

Real kubectl applies the chart's rendered manifests and examples/inferenceservice-cpu.yaml to the emulated API
server; the operator runs from its image (a podman container on the host network: the emulator listens on
loopback, which a pod on podman's bridge cannot reach); the node agent (tests/support/node_agent.py) runs the
operator's pods as podman pods from the engine image; Debian's Prometheus scrapes every pod each second through
file-based discovery; a load generator replays the bursty trace, stretched, against the Service's proxy and counts
every request. The service serves the tiny model's tokenizer on a simulated device (spec.engine.simulatedDevice),
so three replicas have three times the capacity of one on this 2-core machine.

What it must show: 1 -> 3 replicas within 30 s of the queue crossing the watermark, a live retune in the CR status
and in the pods' /metrics, back to 1 replica after the shortened window with the removed pods drained (preStop,
SIGTERM), and no request lost or failed. The report (e2e-report/: table, plot, events) is written every run.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from overlap.bench.traces import resolve_trace, scale_rate, truncate
from overlap.operator import identity
from overlap.operator.control import signals
from tests.support.cluster import (
    NAMESPACE,
    OPERATOR_TOKEN,
    REPO,
    ApiThread,
    Cluster,
    wait_for,
    write_kubeconfig,
)
from tests.support.debian import ensure_prometheus
from tests.support.images import HELM, OPERATOR_IMAGE, require_images
from tests.support.node_agent import NodeAgent, Podman
from tests.support.prometheus import Prometheus
from tests.support.sidecar import http

pytestmark = pytest.mark.e2e

NAME = "tiny-cpu"  # examples/inferenceservice-cpu.yaml
REPORT_DIR = REPO / "e2e-report"
WATERMARK = 4  # queued requests per replica that call for another replica
# The bursty trace (2 s bursts at 300 req/s, 2 s lulls at 60) slowed 40 times: an 80 s burst at 7.5 req/s, then a
# lull at 1.5 req/s. One replica serves about 3 req/s on the simulated device below, three serve about 9.
RATE_FACTOR, LOAD_S = 1 / 40, 110
SIMULATED_DEVICE = {"fixedSeconds": 0.03, "perTokenSeconds": 0.001}

# What the e2e run sets on top of the example (which serves the tiny model baked into the engine image): the
# simulated device, the control loop's windows shortened, and queues deep enough that the burst waits instead of
# being refused.
OVERRIDES = {
    "spec": {
        "engine": {"simulatedDevice": SIMULATED_DEVICE},
        "sidecar": {"maxQueuedRequests": 2000, "maxInflight": 2000, "gracePeriodSeconds": 5},
        "autoscaling": {
            "mode": "builtin", "minReplicas": 1, "maxReplicas": 3, "queueWatermarkPerReplica": WATERMARK,
            "scaleDownWatermark": 1, "scaleUpWindowSeconds": 3, "scaleUpCooldownSeconds": 10,
            "scaleDownWindowSeconds": 20, "scaleDownCooldownSeconds": 10, "intervalSeconds": 5,
        },
        "tuning": {
            "enabled": True, "intervalSeconds": 10, "latencySLO": {"p99Seconds": 2.0},
            "bounds": {"maxNumSeqs": {"min": 4, "max": 16}},
        },
    }
}  # fmt: skip


class OperatorContainer:
    """`overlap operator` from its image, on the host network so it reaches the emulator; removed by id."""

    def __init__(self, podman: Podman, kubeconfig: Path, prometheus_url: str) -> None:
        self.podman = podman
        self.id = podman(
            "run", "--detach", "--network", "host", "--read-only", "--cap-drop", "all",
            "--security-opt", "no-new-privileges", "--volume", f"{kubeconfig}:/kube/config:ro",
            "--env", "KUBECONFIG=/kube/config", OPERATOR_IMAGE,
            "--log-level", "DEBUG", "operator", "--namespace", NAMESPACE, "--standalone",
            "--prometheus-url", prometheus_url, "--signal-window-s", "5",
        )  # fmt: skip

    def log(self) -> str:
        return self.podman.logs(self.id)

    def stop(self) -> None:
        self.podman("rm", "--force", "--time", "5", self.id, check=False)


class LoadGenerator:
    """Replays a trace against the Service's proxy (one connection per request) and accounts for every request."""

    def __init__(self, address: tuple[str, int], model: str) -> None:
        self.url = f"http://{address[0]}:{address[1]}/v1/completions"
        self.model = model
        self.trace = truncate(scale_rate(resolve_trace("bursty"), RATE_FACTOR), duration_s=LOAD_S)
        self.results: list[dict] = []  # per request: sent_s, status, latency_s, tokens, error
        self.started = 0.0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def start(self) -> LoadGenerator:
        self.started = time.monotonic()
        self.thread.start()
        return self

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    async def _run(self) -> None:
        import aiohttp

        # force_close: a pooled keep-alive connection would stay on one pod behind the proxy, so new replicas would
        # get no share of a client's requests (kube-proxy balances connections, not requests).
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks = []
            for index, request in enumerate(self.trace.requests):
                delay = self.started + request.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(session, index, request)))
            await asyncio.gather(*tasks)

    async def _one(self, session, index: int, request) -> None:
        body = {"model": self.model, "prompt": " ".join(["tick"] * request.prompt_tokens),
                "max_tokens": request.max_tokens, "ignore_eos": True}  # fmt: skip
        sent = time.monotonic()
        result = {"index": index, "sent_s": round(sent - self.started, 3), "status": None, "error": None}
        try:
            async with session.post(self.url, json=body) as reply:
                data = await reply.json(content_type=None)
                result["status"] = reply.status
                if reply.status == 200:
                    result["tokens"] = data["usage"]["completion_tokens"]
                    if result["tokens"] != request.max_tokens:
                        result["error"] = f"{result['tokens']} tokens, asked for {request.max_tokens}"
                else:
                    result["error"] = json.dumps(data)[:300]
        except Exception as exc:  # a refused or reset connection: a lost request
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["latency_s"] = round(time.monotonic() - sent, 3)
        self.results.append(result)


class Recorder:
    """Once a second: the CR's replicas and engine config, Prometheus's queue depth and P99, for the report."""

    def __init__(self, cluster: Cluster, prometheus: Prometheus) -> None:
        self.cluster, self.prometheus = cluster, prometheus
        self.queries = signals.queries_for(NAMESPACE, NAME, window_s=10)
        self.rows: list[dict] = []
        self.started = time.monotonic()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="recorder", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(1.0):
            row: dict = {"t": round(time.monotonic() - self.started, 1)}
            try:
                service = self.cluster.service(NAME)
                row["replicas"] = service["spec"].get("replicas")
                row["ready"] = (service.get("status") or {}).get("readyReplicas")
                row["max_num_seqs"] = ((service.get("status") or {}).get("liveKnobs") or {}).get("maxNumSeqs")
                row["queue"] = signals.query(self.prometheus.url, self.queries["queueDepth"])
                row["p99_s"] = signals.query(self.prometheus.url, self.queries["p99Latency"])
            except Exception as exc:  # one missed sample is a gap in the plot, not a failed run
                row["error"] = str(exc)[:200]
            self.rows.append(row)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    require_images()
    ensure_prometheus()
    workdir = tmp_path_factory.mktemp("e2e")
    api_thread = ApiThread()
    started: list = []
    try:
        cluster = Cluster(api_thread, write_kubeconfig(workdir / "kubeconfig", api_thread.url, NAMESPACE))
        rendered = subprocess.run(
            [str(HELM), "template", "overlap", str(REPO / "charts" / "overlap"), "--namespace", "overlap-system"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        cluster.apply("-f", "-", stdin=rendered)
        prometheus = Prometheus.of_discovery_file(workdir, workdir / "pods.json")
        started.append(prometheus)
        agent = NodeAgent(cluster.client, NAMESPACE, workdir / "node", sd_file=workdir / "pods.json").start()
        started.append(agent)
        kubeconfig = write_kubeconfig(workdir / "operator-kubeconfig", api_thread.url, NAMESPACE, OPERATOR_TOKEN)
        kubeconfig.chmod(0o644)
        operator = OperatorContainer(agent.podman, kubeconfig, prometheus.url)
        started.append(operator)
        yield {"cluster": cluster, "agent": agent, "operator": operator, "prometheus": prometheus,
               "workdir": workdir}  # fmt: skip
    finally:
        if len(started) == 3:  # the operator's log and the node's events over the module, whichever test failed
            REPORT_DIR.mkdir(exist_ok=True)
            (REPORT_DIR / "operator.log").write_text(started[2].log())
            (REPORT_DIR / "node-events.txt").write_text("\n".join(started[1].events) + "\n")
        for thing in reversed(started):
            thing.stop()
        api_thread.close()


@pytest.mark.timeout(900)
def test_closed_loop_scales_retunes_and_drains_without_losing_a_request(world):
    cluster, agent, operator = world["cluster"], world["agent"], world["operator"]
    cluster.apply("-f", str(REPO / "examples" / "inferenceservice-cpu.yaml"))
    cluster.kubectl("patch", "inferenceservice", NAME, "--type", "merge", "-p", json.dumps(OVERRIDES))
    recorder = Recorder(cluster, world["prometheus"])
    load = None
    try:
        wait_for(lambda: (cluster.service(NAME).get("status") or {}).get("readyReplicas") == 1, 120,
                 "the first pod to be ready", interval=1)  # fmt: skip
        load = LoadGenerator(agent.service_address(NAME), "tiny").start()

        crossed_at = wait_for(lambda: _queue_crossed(recorder), 60, "the queue to cross the watermark", interval=0.5)
        wait_for(lambda: (cluster.service(NAME).get("status") or {}).get("readyReplicas", 0) >= 3, 60,
                 "three ready replicas", interval=0.5)  # fmt: skip
        scaled_s = time.monotonic() - recorder.started - crossed_at

        retuned = wait_for(lambda: _retuned(cluster), 120, "a live retune in the status", interval=1)
        wait_for(lambda: _pods_report(agent, retuned), 30, "the retuned knob in the pods' /metrics", interval=1)

        load.join(LOAD_S + 300)
        assert not load.thread.is_alive(), "the load generator did not finish"
        wait_for(lambda: cluster.service(NAME)["spec"].get("replicas") == 1, 120, "scale back to 1", interval=1)
        wait_for(lambda: len([p for p in agent.pods.values() if not p.gone]) == 1, 120, "the removed pods gone", 1)
    finally:
        recorder.stop()
        _write_report(recorder, load, agent, operator, cluster)

    failed = [r for r in load.results if r["error"] or r["status"] != 200]
    assert len(load.results) == len(load.trace), "requests unaccounted for"
    assert not failed, f"{len(failed)} of {len(load.results)} requests failed, e.g. {failed[:3]}"
    assert scaled_s <= 30, f"three replicas ready {scaled_s:.0f} s after the queue crossed the watermark"
    drained = agent.terminations
    assert len(drained) >= 2 and all(t["seconds"] >= 5 for t in drained), drained  # preStop ran before SIGTERM
    assert all(code == 0 for t in drained for code in t["exit_codes"].values()), drained  # SIGTERM, not SIGKILL


def _queue_crossed(recorder: Recorder) -> float | None:
    for row in recorder.rows:
        if (row.get("queue") or 0) > WATERMARK:
            return row["t"]
    return None


def _retuned(cluster: Cluster) -> dict | None:
    status = cluster.service(NAME).get("status") or {}
    for cond in status.get("conditions") or []:
        if cond["type"] == "Tuned" and cond["status"] == "True" and cond.get("reason") == "Retuned":
            return status["liveKnobs"]
    return None


def _pods_report(agent: NodeAgent, config: dict) -> bool:
    from tests.support.sidecar import metric_value

    ready = [p for p in agent.pods.values() if p.ready]
    for pod in ready:
        status, _, text = http("GET", f"http://{pod.ip}:8000/metrics", timeout=5)
        if status != 200:
            return False
        seen = metric_value(text if isinstance(text, str) else text.decode(), "overlap_engine_config",
                            'knob="max_num_seqs"')  # fmt: skip
        if seen != config["maxNumSeqs"]:
            return False
    return bool(ready)


def _write_report(recorder: Recorder, load: LoadGenerator | None, agent: NodeAgent, operator, cluster) -> None:
    REPORT_DIR.mkdir(exist_ok=True)
    results = load.results if load else []
    ok = [r for r in results if r["status"] == 200 and not r["error"]]
    latencies = sorted(r["latency_s"] for r in ok)
    p = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]) if latencies else (lambda q: None)
    replicas = [r.get("replicas") for r in recorder.rows if r.get("replicas") is not None]
    seqs = sorted({r.get("max_num_seqs") for r in recorder.rows if r.get("max_num_seqs") is not None})
    crossed = _queue_crossed(recorder)
    three = next(
        (r["t"] for r in recorder.rows if crossed is not None and r["t"] >= crossed and (r.get("ready") or 0) >= 3),
        None,
    )
    summary = {
        "queue crossed the watermark at (s)": crossed,
        "3 replicas ready after that (s)": None if three is None else round(three - crossed, 1),
        "requests": len(load.trace) if load else 0,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "latency_p50_s": p(0.5),
        "latency_p99_s": p(0.99),
        "max_replicas": max(replicas, default=None),
        "max_num_seqs_seen": seqs,
        "terminations": agent.terminations,
        "trace": load.trace.describe() if load else None,
    }
    (REPORT_DIR / "timeline.json").write_text(json.dumps(recorder.rows, indent=1))
    (REPORT_DIR / "requests.json").write_text(json.dumps(results))
    events = json.loads(cluster.core.list_namespaced_event(NAMESPACE, _preload_content=False).data)["items"]
    lines = [f"{e.get('lastTimestamp') or e.get('eventTime') or ''} {e.get('reason')}: {e.get('message')}"
             for e in events]  # fmt: skip
    (REPORT_DIR / "events.txt").write_text("\n".join(["# operator events", *lines, "", "# node agent", *agent.events]))
    table = [
        "| figure | value |", "|---|---|",
        *(f"| {key} | {value} |" for key, value in summary.items() if key not in ("terminations",)),
        *(f"| pod removed | {t['pod']}: {t['seconds']} s, exit codes {t['exit_codes']} |" for t in agent.terminations),
    ]  # fmt: skip
    (REPORT_DIR / "report.md").write_text("# make e2e\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    _plot(recorder.rows, REPORT_DIR / "timeline.png")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    series = [("replicas", "replicas (spec)"), ("queue", "queued requests"), ("p99_s", "P99 latency (s)"),
              ("max_num_seqs", "max_num_seqs (live)")]  # fmt: skip
    for ax, (key, label) in zip(axes, series, strict=True):
        ax.step(t, [r.get(key) if r.get(key) is not None else float("nan") for r in rows], where="post", label=label)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ready = [r.get("ready") if r.get("ready") is not None else float("nan") for r in rows]
    axes[0].step(t, ready, where="post", linestyle="--", label="ready")
    axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("seconds since the service was applied")
    fig.suptitle("make e2e: the closed loop on podman pods")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


ZERO = "tiny-zero"
HELD = 100


def _apply_example(cluster: Cluster, name: str, engine: dict, **spec) -> None:
    """examples/inferenceservice-cpu.yaml under another name, with these engine knobs added and spec fields set."""
    manifest = yaml.safe_load((REPO / "examples" / "inferenceservice-cpu.yaml").read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"].update({**spec, "engine": {**manifest["spec"]["engine"], **engine}})
    cluster.apply("-f", "-", stdin=yaml.safe_dump(manifest))


async def _held_streams(address: tuple[str, int], clients: int, max_tokens: int = 8) -> list[dict]:
    """`clients` streaming completions at once through the Service's proxy, one connection each."""
    import aiohttp

    url = f"http://{address[0]}:{address[1]}/v1/completions"
    body = {"model": "tiny", "prompt": "wake up", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def one(session) -> dict:
        result: dict = {"status": None, "first_token": None, "tokens": None, "error": None}
        try:
            async with session.post(url, json=body) as reply:
                result["status"] = reply.status
                async for raw in reply.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        result["tokens"] = chunk["usage"]["completion_tokens"]
                    elif result["first_token"] is None:
                        result["first_token"] = time.monotonic()
        except Exception as exc:  # a refused or reset connection: a lost request
            result["error"] = f"{type(exc).__name__}: {exc}"
        return result

    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session) for _ in range(clients)))


@pytest.mark.timeout(600)
def test_scale_from_zero_on_pods_serves_every_held_request_then_goes_back_to_zero(world):
    """minReplicas 0: the activator pod answers while no engine pod runs; 100 held streams wake the service, each
    gets its first token within 1 s of the engine pod being ready; idle again, the service goes back to zero."""

    cluster, agent = world["cluster"], world["agent"]
    # The pods reach Services at the gateway by port: the closed loop's service (port 8000 too) goes first.
    cluster.kubectl("delete", "inferenceservice", NAME, "--ignore-not-found")
    wait_for(lambda: not [p for p in agent.pods.values() if p.deployment == NAME and not p.gone], 120,
             "the closed loop's pods gone", interval=1)  # fmt: skip
    _apply_example(
        cluster, ZERO,
        # a batch that takes the whole held burst at once (the example's 8 would queue most of it in the engine)
        {"simulatedDevice": SIMULATED_DEVICE, "maxNumSeqs": 128},
        replicas=0,
        sidecar={"gracePeriodSeconds": 5, "maxQueuedRequests": 256},
        autoscaling={
            "mode": "builtin", "minReplicas": 0, "maxReplicas": 1, "idleTimeoutSeconds": 15,
            "scaleDownWindowSeconds": 5, "scaleDownCooldownSeconds": 5, "intervalSeconds": 5,
        },
    )  # fmt: skip
    try:
        wait_for(lambda: (cluster.apps.read_namespaced_deployment(f"{ZERO}-activator", NAMESPACE).status.ready_replicas
                          or 0) == 1, 120, "the activator pod ready", interval=1)  # fmt: skip
        wait_for(lambda: cluster.core.read_namespaced_service(ZERO, NAMESPACE).spec.selector
                 == identity.activator_labels(ZERO), 30, "the Service routed to the activator")  # fmt: skip
        assert cluster.service(ZERO)["spec"]["replicas"] == 0
        results: list = []
        clients = threading.Thread(
            target=lambda: results.extend(asyncio.run(_held_streams(agent.service_address(ZERO), HELD))), daemon=True
        )
        sent = time.monotonic()
        clients.start()
        wait_for(lambda: cluster.service(ZERO)["spec"]["replicas"] == 1, 60, "the operator to scale 0 -> 1", 0.2)
        scaled = time.monotonic()
        wait_for(lambda: (cluster.apps.read_namespaced_deployment(ZERO, NAMESPACE).status.ready_replicas or 0) == 1,
                 180, "the engine pod ready", interval=0.1)  # fmt: skip
        ready = time.monotonic()
        clients.join(120)
        assert not clients.is_alive(), "the held streams did not finish"
        wait_for(lambda: cluster.core.read_namespaced_service(ZERO, NAMESPACE).spec.selector
                 == identity.selector_labels(ZERO), 30, "the Service routed back to the pods")  # fmt: skip
        # Idle for the timeout: back to zero, the Service on the activator before the pod goes.
        wait_for(lambda: cluster.service(ZERO)["spec"]["replicas"] == 0, 120, "the service back at zero", interval=1)
        wait_for(lambda: cluster.core.read_namespaced_service(ZERO, NAMESPACE).spec.selector
                 == identity.activator_labels(ZERO), 30, "the Service routed to the activator again")  # fmt: skip
        wait_for(lambda: not [p for p in agent.pods.values() if p.deployment == ZERO and not p.gone], 120,
                 "the engine pod gone", interval=1)  # fmt: skip
        decisions = [e for e in agent.events if ZERO in e]
    finally:
        cluster.kubectl("delete", "inferenceservice", ZERO, "--ignore-not-found")
    failed = [r for r in results if r["error"] or r["status"] != 200 or r["tokens"] != 8]
    assert len(results) == HELD and not failed, f"{len(failed)} of {HELD} held requests failed, e.g. {failed[:3]}"
    late = sorted(round(r["first_token"] - ready, 2) for r in results if r["first_token"] - ready > 1.0)
    firsts = sorted(r["first_token"] - ready for r in results)
    print(f"scale-up {scaled - sent:.1f} s after the first request, engine pod ready {ready - scaled:.1f} s later; "
          f"first tokens {firsts[0]:.2f}-{firsts[-1]:.2f} s after it was ready")  # fmt: skip
    assert not late, f"first tokens more than 1 s after the pod was ready: {late[:10]}; agent: {decisions[-10:]}"


STREAMS = "tiny-streams"


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_a_scale_down_on_pods_during_60_s_streams_cuts_none(world, reliability):
    """2 -> 1 replicas while 20 streams of 60 s run on both pods: the removed pod leaves the Service, its preStop
    waits out the endpoint drain, then its sidecar drains on SIGTERM within the grace period: every stream on it
    runs to its last token, and its containers exit 0."""
    cluster, agent = world["cluster"], world["agent"]
    # 240 steps of 0.25 s: a 60 s stream whatever the batch
    engine = {"simulatedDevice": {"fixedSeconds": 0.25, "perTokenSeconds": 0.0}, "maxNumSeqs": 32}
    _apply_example(cluster, STREAMS, engine, replicas=2, sidecar={"gracePeriodSeconds": 90})
    streams, tokens = 20, 240
    removed: list = []
    try:
        wait_for(lambda: (cluster.service(STREAMS).get("status") or {}).get("readyReplicas") == 2, 180,
                 "two ready pods", interval=1)  # fmt: skip
        before = {t["pod"] for t in agent.terminations}
        results: list = []
        clients = threading.Thread(
            target=lambda: results.extend(asyncio.run(_held_streams(agent.service_address(STREAMS), streams, tokens))),
            daemon=True,
        )
        clients.start()
        time.sleep(5)  # the streams are 5 s into their 60 s, spread over both pods by the Service
        cluster.kubectl("patch", "inferenceservice", STREAMS, "--type", "merge", "-p", '{"spec": {"replicas": 1}}')
        clients.join(150)
        assert not clients.is_alive(), "the streams did not finish"
        removed = wait_for(lambda: [t for t in agent.terminations if t["pod"] not in before
                                    and t["pod"].startswith(STREAMS)], 60, "the removed pod gone", 1)  # fmt: skip
    finally:
        cluster.kubectl("delete", "inferenceservice", STREAMS, "--ignore-not-found")
        wait_for(lambda: not [p for p in agent.pods.values() if p.deployment == STREAMS and not p.gone], 150,
                 "the service's pods gone", interval=1)  # fmt: skip
    cut = [r for r in results if r["error"] or r["status"] != 200 or r["tokens"] != tokens]
    assert len(results) == streams and not cut, f"{len(cut)} of {streams} streams cut, e.g. {cut[:3]}"
    (pod,) = removed
    # it stayed until its streams ended (55 s after the scale-down), then went: the engine's preStop returns once the
    # sidecar is gone, not after the whole 5 + 90 s; both exited on SIGTERM, not SIGKILL
    assert 50 <= pod["seconds"] < 80 and all(code == 0 for code in pod["exit_codes"].values()), pod
    print(f"the removed pod drained its streams and went {pod['seconds']} s after the scale-down")
    reliability.row(
        "Pods", "scale-down 2 -> 1 during 60 s streams",
        load=f"{streams} streams of {tokens} tokens over both pods", accepted=streams, answered=streams - len(cut),
        outcome=f"every stream ran to its last token; the removed pod left the Service, drained and went "
        f"{pod['seconds']} s after the scale-down, exit codes {pod['exit_codes']}",
    )  # fmt: skip


RESTART = "tiny-restart"


async def _steady_load(address: tuple[str, int], rate: float, duration_s: float) -> list[dict]:
    """`rate` completions a second for `duration_s` through the Service's proxy: each one's send time, status and
    error message (an OpenAI error body, or what broke the connection)."""
    import aiohttp

    url = f"http://{address[0]}:{address[1]}/v1/completions"
    body = {"model": "tiny", "prompt": "keep going", "max_tokens": 16, "ignore_eos": True}

    async def one(session) -> dict:
        result: dict = {"sent": time.monotonic(), "status": None, "error": None}
        try:
            async with session.post(url, json=body) as reply:
                result["status"] = reply.status
                data = await reply.json()
                if reply.status != 200:
                    result["error"] = data["error"]["message"]
                elif data["usage"]["completion_tokens"] != 16:
                    result["error"] = f"{data['usage']['completion_tokens']} tokens"
        except Exception as exc:  # a refused or reset connection: no answer
            result["error"] = f"connection: {type(exc).__name__}: {exc}"
        return result

    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        for _ in range(int(rate * duration_s)):
            tasks.append(asyncio.create_task(one(session)))
            await asyncio.sleep(1 / rate)
        return await asyncio.gather(*tasks)


def _steady_load_in_background(address: tuple[str, int], rate: float, duration_s: float):
    """`_steady_load` on its own thread, started now: (the thread, the list its results land in once it ends)."""
    results: list = []
    thread = threading.Thread(
        target=lambda: results.extend(asyncio.run(_steady_load(address, rate, duration_s))), daemon=True
    )
    thread.start()
    return thread, results


def _security_of(podman: Podman, container_id: str) -> dict:
    """What the container's main process really runs as, read inside it."""
    status = podman("exec", container_id, "cat", "/proc/1/status")
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    write = subprocess.run(["podman", "exec", container_id, "touch", "/overlap-write-test"], capture_output=True,
                           env=podman.env)  # fmt: skip
    return {
        "uid": int(fields["Uid"].split()[1]),
        "cap_eff": int(fields["CapEff"], 16),
        "no_new_privs": fields.get("NoNewPrivs", "").strip() == "1",
        "root_writable": write.returncode == 0,
    }


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_an_engine_container_killed_under_load_is_restarted_and_nothing_goes_unanswered(world, reliability):
    """Two pods under a steady load; one pod's engine container is killed (SIGKILL): the node restarts it, the sidecar
    answers what it held with a clear 503 and reconnects, and every request gets an answer. Meanwhile the running
    containers are checked for what their securityContext promises."""
    cluster, agent = world["cluster"], world["agent"]
    engine = {"simulatedDevice": {"fixedSeconds": 0.02, "perTokenSeconds": 0.0}, "maxNumSeqs": 32}
    _apply_example(cluster, RESTART, engine, replicas=2)
    try:
        wait_for(lambda: (cluster.service(RESTART).get("status") or {}).get("readyReplicas") == 2, 180,
                 "two ready pods", interval=1)  # fmt: skip
        pods = [p for p in agent.pods.values() if p.deployment == RESTART and not p.gone]
        security = {f"{p.name}/{c.name}": _security_of(agent.podman, c.id) for p in pods for c in p.containers}
        load, results = _steady_load_in_background(agent.service_address(RESTART), 10, 40)
        time.sleep(8)
        victim = pods[0]
        engine_container = next(c for c in victim.containers if c.name == "engine")
        readyz = f"http://{victim.ip}:8000/readyz"
        agent.podman("kill", "--signal", "KILL", engine_container.id)
        killed = time.monotonic()
        wait_for(lambda: http("GET", readyz, timeout=2)[0] == 503, 10, "the sidecar to see the engine gone", 0.05)
        wait_for(lambda: engine_container.restarts == 1 and http("GET", readyz, timeout=2)[0] == 200, 120,
                 "the engine restarted and the sidecar ready again", interval=0.1)  # fmt: skip
        back_s = time.monotonic() - killed
        load.join(120)
        assert not load.is_alive(), "the load did not finish"
        sidecar_restarts = next(c.restarts for c in victim.containers if c.name == "sidecar")
    finally:
        cluster.kubectl("delete", "inferenceservice", RESTART, "--ignore-not-found")
        wait_for(lambda: not [p for p in agent.pods.values() if p.deployment == RESTART and not p.gone], 150,
                 "the service's pods gone", interval=1)  # fmt: skip
    unanswered = [r for r in results if r["status"] is None]
    failed = [r for r in results if r["status"] is not None and r["error"]]
    assert not unanswered, f"{len(unanswered)} requests got no answer, e.g. {unanswered[:3]}"
    assert all(r["status"] == 503 and "engine" in r["error"] for r in failed), failed[:3]
    assert all(r["sent"] < killed + back_s for r in failed)  # once its sidecar was ready again, nothing failed
    assert sidecar_restarts == 0  # only the engine container restarted
    for name, found in security.items():
        assert found == {"uid": found["uid"], "cap_eff": 0, "no_new_privs": True, "root_writable": False}, (name, found)
        assert found["uid"] != 0, (name, found)
    print(f"engine killed: back and ready {back_s:.1f} s later; {len(failed)} of {len(results)} requests got a 503")
    reliability.row(
        "Pods", "a pod's engine container killed (SIGKILL) under load",
        load=f"{len(results)} completions at 10/s over two pods for 40 s",
        outcome=f"the node restarted it (the sidecar kept running), the sidecar ready again {back_s:.1f} s later; "
        f"{len(failed)} requests reaching that pod meanwhile got a 503 naming the engine (with Retry-After), every "
        f"other one served",
        accepted=len(results), answered=len(results) - len(unanswered),
    )  # fmt: skip
    uids = sorted({s["uid"] for s in security.values()})
    reliability.row(
        "Security", "the running pods' containers: user, capabilities, root filesystem",
        load=f"{len(security)} containers of two pods, read inside each",
        outcome=f"every one non-root (uid {', '.join(map(str, uids))}), no effective capabilities, no_new_privs "
        "set, its root filesystem read-only",
    )  # fmt: skip


ROLLING = "tiny-rolling"


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_a_rolling_restart_of_every_replica_under_load_fails_no_request(world, reliability):
    """`kubectl rollout restart` of a two-pod service under a steady load: the node replaces the pods one by one (the
    Deployment's surge and unavailability limits), each old pod leaves the Service before it drains; every request
    sent meanwhile is served."""
    cluster, agent = world["cluster"], world["agent"]
    engine = {"simulatedDevice": {"fixedSeconds": 0.02, "perTokenSeconds": 0.0}, "maxNumSeqs": 32}
    _apply_example(cluster, ROLLING, engine, replicas=2)

    def pods() -> list:
        return [p for p in agent.pods.values() if p.deployment == ROLLING and not p.gone]

    try:
        wait_for(lambda: (cluster.service(ROLLING).get("status") or {}).get("readyReplicas") == 2, 180,
                 "two ready pods", interval=1)  # fmt: skip
        old = {p.name for p in pods()}
        load, results = _steady_load_in_background(agent.service_address(ROLLING), 10, 70)
        time.sleep(5)
        cluster.kubectl("rollout", "restart", f"deployment/{ROLLING}")
        restarted = time.monotonic()
        wait_for(lambda: (now := pods()) and not {p.name for p in now} & old and sum(p.ready for p in now) == 2,
                 180, "every pod replaced and ready", interval=0.5)  # fmt: skip
        rollout_s = time.monotonic() - restarted
        load.join(150)
        assert not load.is_alive(), "the load did not finish"
    finally:
        cluster.kubectl("delete", "inferenceservice", ROLLING, "--ignore-not-found")
        wait_for(lambda: not pods(), 150, "the service's pods gone", interval=1)
    failed = [r for r in results if r["status"] != 200 or r["error"]]
    assert results and not failed, f"{len(failed)} of {len(results)} requests failed, e.g. {failed[:3]}"
    print(f"rolling restart: both pods replaced in {rollout_s:.1f} s, {len(results)} requests all served")
    reliability.row(
        "Pods", "a rolling restart of every replica (`kubectl rollout restart`) under load",
        load=f"{len(results)} completions at 10/s over two pods for 70 s",
        outcome=f"both pods replaced one by one in {rollout_s:.1f} s (new one ready before an old one left the "
        "Service and drained); every request served",
        accepted=len(results), answered=len(results) - len(failed),
    )  # fmt: skip
