"""The control loop end to end: real Prometheus scrapes a real sidecar and engine process, the real operator reads
it, scales the InferenceService on the queue watermark and retunes the running engine through its admin port.

What the harness plays: the Deployment controller (readyReplicas) and the pod (a Pod object whose IP is 127.0.0.1,
so the operator's admin PUT reaches the sidecar started here). The engine is the real Engine and EngineServer with
the sidecar tests' scripted runner (tests/support/fake_engine_server.py: no torch, a fixed time per step).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from overlap.operator.control import signals
from overlap.operator.control.policy import Signals
from tests.support.cluster import (
    NAMESPACE,
    REPO,
    chart_grants,
    not_granted,
    operator_requests,
    running_operator,
    wait_for,
)
from tests.support.debian import ensure_prometheus
from tests.support.prometheus import Prometheus
from tests.support.sidecar import Stack, free_port, http, metric_value

NAME = "looped"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    """An engine (scripted runner, 20 ms steps) and a sidecar, serving like one pod of NAME."""
    stack = Stack(tmp_path_factory.mktemp("pod", numbered=True), tiny_model_dir, step_s=0.02)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, served: Stack) -> Iterator[Prometheus]:
    try:
        ensure_prometheus()
    except subprocess.CalledProcessError:
        pytest.skip("prometheus is not installed: run `make prometheus`")
    labels = {"namespace": NAMESPACE, "service": NAME}
    server = Prometheus.of_targets(tmp_path_factory.mktemp("prometheus"), {f"127.0.0.1:{served.port}": labels})
    try:
        yield server
    finally:
        server.stop()


class Load:
    """Clients that keep `clients` long streams open against the sidecar until stopped."""

    def __init__(self, base_url: str, model: str, clients: int) -> None:
        self.stopped = threading.Event()
        self.statuses: list[int] = []
        body = {"model": model, "prompt": "tick tock", "max_tokens": 40, "ignore_eos": True}
        self.threads = [
            threading.Thread(target=self._loop, args=(f"{base_url}/v1/completions", body), daemon=True)
            for _ in range(clients)
        ]
        for thread in self.threads:
            thread.start()

    def _loop(self, url: str, body: dict) -> None:
        while not self.stopped.is_set():
            self.statuses.append(http("POST", url, body, timeout=60)[0])

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(90)


def test_signals_read_from_prometheus_match_the_sidecar(prometheus: Prometheus, served: Stack):
    queries = signals.queries_for(NAMESPACE, NAME)
    wait_for(lambda: signals.query(prometheus.url, queries["queueDepth"]) is not None, 20, "the first scrape")
    wait_for(lambda: signals.query(prometheus.url, queries["arrivalRate"]) is not None, 20, "a second scrape (rate)")
    reading = signals.read_signals(prometheus.url, queries, ready_replicas=1, now=time.time())
    assert reading.queue_depth == 0  # idle: the sidecar says 0 waiting, Prometheus too
    assert reading.kv_cache_usage == 0
    assert 0 <= reading.device_busy <= 1
    assert reading.p99_latency_s is None  # no request finished yet: no reading rather than a made-up 0
    assert reading.arrival_rate == 0 and reading.running == 0  # the counters exist at 0 from the first scrape on
    assert reading.scraped_replicas == 1 and reading.stale == ()
    other = signals.queries_for(NAMESPACE, "another-service")
    assert signals.query(prometheus.url, other["queueDepth"]) is None  # the selector keeps services apart


def test_every_dashboard_query_parses_and_reads_series_the_sidecar_exposes(prometheus: Prometheus, served: Stack):
    dashboard = json.loads((REPO / "charts" / "overlap" / "files" / "dashboards" / "overlap.json").read_text())
    exposed = {line.split("{")[0].split(" ")[0] for line in served.metrics().splitlines() if not line.startswith("#")}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$namespace", NAMESPACE).replace("$service", NAME)
            for metric in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr):
                assert metric in exposed, f"panel {panel['title']!r} reads {metric}, which the sidecar does not expose"
            status, _, body = http("GET", f"{prometheus.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
            assert status == 200 and body["status"] == "success", (panel["title"], body)


def test_prometheus_problems_get_clear_errors(prometheus: Prometheus):
    with pytest.raises(signals.PrometheusError, match=r"Prometheus refused 'sum\(': 400"):
        signals.query(prometheus.url, "sum(")
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(signals.PrometheusError, match=f"cannot query Prometheus at {nobody}: .*refused"):
        signals.query(nobody, "up")
    # one that accepts connections and never answers: the tick's queries wait out one timeout together, not one
    # after another (14 x 0.5 s)
    import socket

    queries = signals.queries_for("ns", "llm")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(32)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(signals.PrometheusUnreachable, match="timed out"):
            signals.read_signals(url, queries, ready_replicas=1, now=0.0, timeout_s=0.5)
        assert time.monotonic() - started < len(queries) * 0.5 / 2
        silent.setblocking(False)
        asked = 0
        while True:
            try:
                silent.accept()[0].close()
            except BlockingIOError:
                break
            asked += 1
        assert asked == len(queries)


def test_a_ticks_queries_go_to_prometheus_at_once():
    """Each query of a tick is answered only once all of them have arrived: sent one after another, the first would
    wait for the others until the barrier gave up, and every signal would fail."""
    import http.server

    queries = signals.queries_for("ns", "llm")
    barrier = threading.Barrier(len(queries), timeout=3)

    class AllAtOnce(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                barrier.wait()
                status, body = 200, {"status": "success", "data": {"result": [{"value": [0, "2"]}]}}
            except threading.BrokenBarrierError:
                status, body = 503, {"status": "error", "error": "not all queries arrived together"}
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AllAtOnce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reading = signals.read_signals(url, queries, ready_replicas=1, now=0.0, timeout_s=15)
    finally:
        server.shutdown()
        server.server_close()
    assert not reading.stale and reading.queue_depth == 2.0 and reading.device_busy == 2.0


def test_a_signal_with_no_reading_this_tick_leaves_the_status_instead_of_keeping_its_last_value(monkeypatch):
    """status.signals is written whole each tick: a signal gone (no replica, so no waiting per replica) is deleted
    (null in the merge patch), not shown with its last value by `kubectl get -o wide`."""
    import logging

    from overlap.operator import kube
    from overlap.operator import spec as specs
    from overlap.operator.control import loop
    from overlap.operator.control.policy import History, Policy
    from tests.support.kube.server import merge_patch

    spec = specs.with_defaults({"model": {"servedName": "llm", "path": "/models/llm"},
                                "autoscaling": {"mode": "builtin"}})  # fmt: skip
    stored = {"metadata": {"name": "llm", "namespace": "ns"},
              "status": {"readyReplicas": 0, "signals": {"readyReplicas": 1, "queueDepth": 12.0,
                                                          "waitingPerReplica": 12.0}}}  # fmt: skip
    written = []
    monkeypatch.setattr(signals, "read_signals", lambda *a, **k: Signals(time=0.0, ready_replicas=0))
    monkeypatch.setattr(kube, "patch_status", lambda name, namespace, compute: written.append(compute(stored)))
    policy = Policy.from_spec(spec)
    loop.run_tick(stored, spec, specs.check_spec(spec), policy, loop.LoopState(History(scaling=policy.scaling)), 0.0,
                  logging.getLogger("test"), "http://prometheus")  # fmt: skip
    patch = written[-1]["signals"]
    assert patch["queueDepth"] is None and patch["waitingPerReplica"] is None and patch["readyReplicas"] == 0
    assert merge_patch(stored["status"], {"signals": patch})["signals"] == {"readyReplicas": 0}


def _service(spec_extra: dict, admin_port: int) -> str:
    spec = {
        "model": {"servedName": "tiny", "path": "/models/tiny"},
        "resources": {"gpus": 0},
        "replicas": 1,
        "engine": {"maxNumSeqs": 2},
        "sidecar": {"adminPort": admin_port},
        **spec_extra,
    }
    manifest = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME}}
    return yaml.safe_dump({**manifest, "spec": spec})


def _play_pod(cluster, name: str) -> None:
    """A Ready pod of the service whose IP is loopback: the sidecar of `served` answers for it."""
    labels = {"app.kubernetes.io/name": "overlap", "overlap.dev/inferenceservice": name}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-0", "labels": labels},
        "spec": {"containers": [{"name": "sidecar", "image": "overlap"}]},
    }
    if cluster.core.list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={name}-0").items:
        cluster.core.delete_namespaced_pod(f"{name}-0", NAMESPACE)  # left by an earlier test (no owner)
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    ready = {"podIP": "127.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    cluster.core.patch_namespaced_pod_status(f"{name}-0", NAMESPACE, {"status": ready})


def _engine_knob(served: Stack, knob: str) -> float | None:
    """A live knob as the sidecar's /metrics reports it (overlap_engine_config), no admin token needed."""
    return metric_value(served.metrics(), "overlap_engine_config", f'knob="{knob}"')


def _live_config(served: Stack, token: str) -> dict:
    status, _, body = http("GET", f"{served.admin_url}/admin/config", headers={"Authorization": f"Bearer {token}"})
    assert status == 200, body
    return body["config"]


@contextlib.contextmanager
def _service_applied(cluster, manifest: str) -> Iterator[None]:
    """The service applied, and deleted on the way out even when the test failed: the next test reuses the name,
    and a status left behind (a lastDecision) would fail it for the wrong reason. Inside `running_operator`: the
    delete waits for kopf to remove its finalizer."""
    cluster.apply("-f", "-", stdin=manifest)
    try:
        yield
    finally:
        cluster.kubectl("delete", "inferenceservice", NAME, "-n", NAMESPACE, "--ignore-not-found")


def test_scales_up_on_the_queue_then_retunes_the_running_engine(cluster, prometheus, served, tmp_path):
    spec_extra = {
        # Window 0 and a 5 s tick: the test sees a decision within seconds; the windows are tested in test_controller.
        "autoscaling": {
            "mode": "builtin", "minReplicas": 1, "maxReplicas": 3, "queueWatermarkPerReplica": 2,
            "scaleDownWatermark": 1, "scaleUpWindowSeconds": 0, "scaleUpCooldownSeconds": 600, "intervalSeconds": 5,
        },
        # maxNumSeqs may go 2 -> 4 and no further up (tune before scale raises it first), and the tuner does not
        # undo a move within three waits: the knob stays 4 while the test checks where it landed.
        "tuning": {
            "enabled": True, "intervalSeconds": 5, "latencySLO": {"p99Seconds": 0.05},
            "bounds": {"maxNumSeqs": {"min": 1, "max": 4}},
        },
    }  # fmt: skip
    folder = tmp_path / "operator"
    folder.mkdir()
    with (
        running_operator(
            cluster,
            folder,
            "--namespace",
            NAMESPACE,
            "--standalone",
            "--prometheus-url",
            prometheus.url,
            "--signal-window-s",
            "5",
        ) as operator,
        _service_applied(cluster, _service(spec_extra, served.admin_port)),
    ):
        # Play the kubelet: the pod mounts its key of the namespace's token Secret, which the sidecar follows.
        tokens = wait_for(lambda: cluster.core.read_namespaced_secret("overlap-admin-tokens", NAMESPACE), 20, "tokens")
        token = base64.b64decode(tokens.data[NAME]).decode()
        served.token_file.write_text(token)
        # Play the kubelet: the pod mounts the ConfigMap's engine.json, which the sidecar watches.
        configmap = wait_for(lambda: cluster.core.read_namespaced_config_map(f"{NAME}-engine", NAMESPACE), 20, "CM")
        served.config_file.write_text(configmap.data["engine.json"])
        wait_for(lambda: _live_config(served, token)["max_num_seqs"] == 2, 20, "the sidecar to apply the file")
        _play_pod(cluster, NAME)
        wait_for(lambda: cluster.apps.read_namespaced_deployment(NAME, NAMESPACE), 20, "the Deployment")
        cluster.play_deployment_controller(NAME)

        load = Load(served.base_url, served.model, clients=10)  # 2 running, ~8 waiting: 8 per replica > 2
        try:
            # Tune before scale: the batch (2) is full and the KV cache nearly empty, so the loop first raises
            # max_num_seqs to its bound (2 -> 4), and adds replicas only when the queue stays over the watermark.
            retuned = wait_for(
                lambda: (s := cluster.service(NAME))["status"].get("lastDecision", {}).get("action") == "retune" and s,
                60,
                "the control loop to retune",
            )
            scaled = wait_for(
                lambda: (
                    (s := cluster.service(NAME))["spec"]["replicas"] == 3
                    and s["status"]["lastDecision"]["action"] == "scale-up"
                    and s
                ),
                60,
                "the control loop to scale up",
            )
            wait_for(
                lambda: cluster.apps.read_namespaced_deployment(NAME, NAMESPACE).spec.replicas == 3,
                20,
                "the Deployment to follow spec.replicas",
            )
            cluster.play_deployment_controller(NAME)
        finally:
            load.stop()

        decision = retuned["status"]["lastDecision"]
        assert "tune before scale" in decision["reason"] and "max_num_seqs 2 -> 4" in decision["reason"]
        assert "batch full" in decision["reason"]
        assert retuned["status"]["liveKnobs"]["maxNumSeqs"] == 4
        assert retuned["spec"]["replicas"] == 1  # the retune came instead of a replica
        decision = scaled["status"]["lastDecision"]
        assert decision["replicas"] == 3 and "waiting per ready replica > watermark 2" in decision["reason"]
        assert scaled["status"]["signals"]["queueDepth"] > 2
        # The running engine got it through the admin port, not through a file sync (the harness did not copy it).
        assert _live_config(served, token)["max_num_seqs"] == 4
        assert json.loads(served.config_file.read_text())["max_num_seqs"] == 2
        engine_json = json.loads(
            cluster.core.read_namespaced_config_map(f"{NAME}-engine", NAMESPACE).data["engine.json"]
        )
        assert engine_json["max_num_seqs"] == 4  # new and restarted pods start tuned
        conditions = {c["type"]: c for c in scaled["status"]["conditions"]}
        assert conditions["Tuned"]["status"] == "True" and conditions["Tuned"]["reason"] == "Retuned"
        assert (conditions["Scaling"]["status"], conditions["Scaling"]["reason"]) == ("True", "ScaledUp")
        events = cluster.core.list_namespaced_event(NAMESPACE).items
        assert {"ScaledUp", "Retuned"} <= {e.reason for e in events if e.involved_object.name == NAME}
        # Every request the clients sent was served: nothing refused, nothing lost while the knobs moved.
        assert load.statuses and set(load.statuses) == {200}
        assert "control loop: scale-up" in operator.log()
        wide = cluster.kubectl("get", "oisvc", NAME, "-o", "wide").stdout.splitlines()
        assert wide[0].split()[-2:] == ["WAITING", "DECISION"] and wide[1].split()[-1] == "scale-up"
        used = operator_requests(cluster)
        assert ("list", "", "pods", None) in used, sorted(used)
        assert not not_granted(used, chart_grants()), sorted(not_granted(used, chart_grants()))

        # A reconcile (any spec edit) keeps the tuned value: the tuner owns the knob while tuning is on.
        patch = {"spec": {"sidecar": {"gracePeriodSeconds": 20}}}
        cluster.custom.patch_namespaced_custom_object(
            "overlap.dev", "v1alpha1", NAMESPACE, "inferenceservices", NAME, patch
        )
        wait_for(
            lambda: (s := cluster.service(NAME))["status"]["observedGeneration"] == s["metadata"]["generation"],
            20,
            "the reconcile of the edit",
        )
        engine_json = json.loads(
            cluster.core.read_namespaced_config_map(f"{NAME}-engine", NAMESPACE).data["engine.json"]
        )
        assert engine_json["max_num_seqs"] == 4


def test_advise_mode_reports_the_scale_up_and_applies_nothing(cluster, prometheus, served, tmp_path):
    spec_extra = {
        "autoscaling": {
            "mode": "advise", "minReplicas": 1, "maxReplicas": 3, "queueWatermarkPerReplica": 2,
            "scaleDownWatermark": 1, "scaleUpWindowSeconds": 0, "scaleUpCooldownSeconds": 600, "intervalSeconds": 5,
        },
    }  # fmt: skip
    with running_operator(
        cluster, tmp_path, "--namespace", NAMESPACE, "--standalone", "--prometheus-url", prometheus.url,
        "--signal-window-s", "5",
    ), _service_applied(cluster, _service(spec_extra, served.admin_port)):  # fmt: skip
        # Play the kubelet: the pod mounts the ConfigMap's engine.json (maxNumSeqs 2), which the sidecar watches.
        configmap = wait_for(lambda: cluster.core.read_namespaced_config_map(f"{NAME}-engine", NAMESPACE), 20, "CM")
        # (An earlier test's retune reached this sidecar through its admin port: a file edit resets the knob.)
        served.config_file.write_text(json.dumps({"max_num_seqs": 3}))
        wait_for(lambda: _engine_knob(served, "max_num_seqs") == 3, 20, "the sidecar to apply the file")
        served.config_file.write_text(configmap.data["engine.json"])
        wait_for(lambda: _engine_knob(served, "max_num_seqs") == 2, 20, "the sidecar to apply the file")
        _play_pod(cluster, NAME)
        wait_for(lambda: cluster.apps.read_namespaced_deployment(NAME, NAMESPACE), 20, "the Deployment")
        cluster.play_deployment_controller(NAME)
        load = Load(served.base_url, served.model, clients=10)
        try:
            advised = wait_for(
                lambda: "lastAdvice" in (s := cluster.service(NAME)).get("status", {}) and s, 60, "the advice"
            )
            signals_seen = wait_for(
                lambda: (s := cluster.service(NAME)["status"]["signals"]).get("arrivalRate", 0) > 0 and s,
                20,
                "the arrival rate in status.signals",
            )
        finally:
            load.stop()
        advice = advised["status"]["lastAdvice"]
        assert advice["action"] == "scale-up" and advice["replicas"] == 3
        assert advised["spec"]["replicas"] == 1 and "lastDecision" not in advised["status"]  # nothing applied
        assert cluster.apps.read_namespaced_deployment(NAME, NAMESPACE).spec.replicas == 1
        conditions = {c["type"]: c for c in advised["status"]["conditions"]}
        assert (
            conditions["Scaling"]["reason"] == "Advised" and "would scale-up to 3" in conditions["Scaling"]["message"]
        )
        events = cluster.core.list_namespaced_event(NAMESPACE).items
        assert "Advised" in {e.reason for e in events if e.involved_object.name == NAME}
        assert advised["status"]["forecast"]["horizonSeconds"] > 0
        assert signals_seen["scrapedReplicas"] == 1 and signals_seen["finishRate"] > 0


def _scaling_condition(cluster, name: str) -> dict | None:
    conditions = cluster.service(name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "Scaling"), None)


def test_a_failing_query_holds_with_a_condition_naming_it(cluster, prometheus, tmp_path):
    spec = {
        "model": {"servedName": "tiny", "path": "/models/tiny"},
        "autoscaling": {"mode": "builtin", "intervalSeconds": 5},
        "prometheus": {"url": prometheus.url, "queries": {"kvCacheUsage": "max(vllm:kv_cache_usage_perc{$selector}"}},
    }
    manifest = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "stale"}}
    with running_operator(cluster, tmp_path, "--namespace", NAMESPACE, "--standalone"):
        cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
        condition = wait_for(lambda: _scaling_condition(cluster, "stale"), 30, "the Scaling condition")
        assert (condition["status"], condition["reason"]) == ("Unknown", "StaleSignals")
        assert "kvCacheUsage" in condition["message"]
        assert cluster.service("stale")["spec"]["replicas"] == 1
        cluster.kubectl("delete", "oisvc", "stale", "-n", NAMESPACE)


def test_signals_to_status_leaves_missing_readings_out():
    reading = Signals(time=0, ready_replicas=2, queue_depth=5, device_busy=None)
    assert signals.to_status(reading) == {"readyReplicas": 2, "queueDepth": 5, "waitingPerReplica": 2.5}


@pytest.mark.reliability
def test_without_prometheus_the_loop_holds_and_says_why(cluster, tmp_path, reliability):
    nobody = f"http://127.0.0.1:{free_port()}"
    spec = {
        "model": {"servedName": "tiny", "path": "/models/tiny"},
        "autoscaling": {"mode": "builtin", "intervalSeconds": 5},
        "prometheus": {"url": nobody},
    }
    manifest = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "blind"}}
    with running_operator(cluster, tmp_path, "--namespace", NAMESPACE, "--standalone"):
        cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
        condition = wait_for(lambda: _scaling_condition(cluster, "blind"), 30, "the Scaling condition")
        assert condition["status"] == "Unknown" and condition["reason"] == "NoSignals"
        assert f"cannot query Prometheus at {nobody}" in condition["message"]
        assert cluster.service("blind")["spec"]["replicas"] == 1  # nothing moved
        cluster.kubectl("delete", "oisvc", "blind", "-n", NAMESPACE)
    reliability.row(
        "Operator", "Prometheus unreachable", load="a builtin-autoscaled InferenceService",
        outcome=f"replicas held; Scaling condition Unknown/NoSignals: {condition['message']!r}",
    )  # fmt: skip


@pytest.mark.long
@pytest.mark.reliability
def test_prometheus_going_away_while_the_loop_runs_holds_everything_until_it_is_back(
    cluster, served, tmp_path, reliability
):
    """Prometheus stops answering after the loop has read it: an idle service that a whole quiet window would
    scale in keeps its replicas and its engine config while the condition says why; once signals read again (a
    new Prometheus, the spec pointed at it), the window passes and it scales in."""
    name = "held"
    labels = {"namespace": NAMESPACE, "service": name}
    (tmp_path / "prom-1").mkdir(), (tmp_path / "prom-2").mkdir()
    first = Prometheus.of_targets(tmp_path / "prom-1", {f"127.0.0.1:{served.port}": labels})
    spec = {
        "model": {"servedName": "tiny", "path": "/models/tiny"},
        "replicas": 2,
        "engine": {"maxNumSeqs": 2},
        "autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 5,
                        "scaleDownWindowSeconds": 15, "scaleDownCooldownSeconds": 0},
        "prometheus": {"url": first.url},
    }  # fmt: skip
    manifest = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}}
    second = None
    folder = tmp_path / "operator"
    folder.mkdir()
    try:
        with running_operator(cluster, folder, "--namespace", NAMESPACE, "--standalone", "--signal-window-s", "5"):
            cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
            wait_for(lambda: cluster.apps.read_namespaced_deployment(name, NAMESPACE), 20, "the Deployment")
            cluster.play_deployment_controller(name)
            engine_json = lambda: cluster.core.read_namespaced_config_map(f"{name}-engine", NAMESPACE).data  # noqa: E731
            before = wait_for(engine_json, 20, "the engine ConfigMap")
            wait_for(lambda: (cluster.service(name).get("status") or {}).get("signals", {}).get("readyReplicas") == 2,
                     30, "a first reading from Prometheus")  # fmt: skip
            first.stop()  # before a whole quiet window could pass
            gone = time.monotonic()
            held = wait_for(lambda: (c := _scaling_condition(cluster, name)) and c["reason"] == "NoSignals" and c,
                            30, "the NoSignals condition")  # fmt: skip
            time.sleep(max(0.0, 30 - (time.monotonic() - gone)))  # twice the window, six ticks, with nothing read
            assert cluster.service(name)["spec"]["replicas"] == 2
            assert engine_json() == before
            assert _scaling_condition(cluster, name)["reason"] == "NoSignals"
            assert f"cannot query Prometheus at {first.url}" in held["message"]
            second = Prometheus.of_targets(tmp_path / "prom-2", {f"127.0.0.1:{served.port}": labels})
            back = time.monotonic()
            patch = {"spec": {"prometheus": {"url": second.url}}}
            cluster.custom.patch_namespaced_custom_object("overlap.dev", "v1alpha1", NAMESPACE, "inferenceservices",
                                                          name, patch)  # fmt: skip
            wait_for(lambda: cluster.service(name)["spec"]["replicas"] == 1, 60, "the scale-in once signals are back")
            resumed_s = time.monotonic() - back
            cluster.kubectl("delete", "oisvc", name, "-n", NAMESPACE)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    reliability.row(
        "Operator", "Prometheus stopped while the loop runs (after its first reading)",
        load="an idle builtin-autoscaled InferenceService at 2 replicas (scale-in after a 15 s quiet window)",
        outcome=f"for 30 s: replicas and engine config held, Scaling Unknown/NoSignals ({held['message']!r}); with "
        f"a new Prometheus it scaled in to 1, {resumed_s:.0f} s later",
    )  # fmt: skip
