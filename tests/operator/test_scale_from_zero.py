"""Scale from zero with no errors, with real processes: `overlap activator` holds 100 concurrent streaming requests
while the service has no replica; a real Prometheus scrapes the activator; the real operator reads the held
requests and scales the InferenceService 0 -> 1; the test plays the kubelet and starts the pod (a real sidecar in
front of the sidecar tests' scripted engine) once the Deployment asks for it; the activator forwards everything.

Then the activator's refusals: a full hold and a hold past its deadline get 503 with Retry-After, never a 404.
And the other way: a scale-down during 60 s streams cuts none of them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from overlap.operator import identity
from tests.support.cluster import NAMESPACE, running_operator, wait_for
from tests.support.debian import ensure_prometheus
from tests.support.prometheus import Prometheus
from tests.support.sidecar import Proc, Stack, free_port, http, metric_value, overlap_cmd

NAME = "sleepy"
CLIENTS = 100


def start_activator(workdir: Path, upstream: str, *flags: str) -> tuple[Proc, str]:
    port = free_port()
    cmd = overlap_cmd("activator", "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port),
                      "--probe-interval-s", "0.1", *flags)  # fmt: skip
    proc = Proc(cmd, workdir / "activator.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http("GET", f"{url}/activator/healthz", timeout=2)[0] == 200, 30, "the activator")
    except BaseException:
        proc.stop()  # stopped by its PID whatever failed
        raise
    return proc, url


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    """One streaming completion through the activator: its status, when its first token came, and its text."""
    body = {"model": model, "prompt": "wake up", "max_tokens": 8, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        first, chunks = None, []
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.monotonic()
                chunks.append(json.loads(line[6:]))
        return {"status": response.status, "sent": sent, "first_token": first, "chunks": chunks}


async def many_streams(url: str, model: str, clients: int) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(stream_completion(session, url, model) for _ in range(clients)))


def test_scale_from_zero_serves_every_held_request(cluster, tmp_path, tiny_model_dir):
    try:
        ensure_prometheus()
    except subprocess.CalledProcessError:
        pytest.skip("prometheus is not installed: run `make prometheus`")
    for folder in ("pod", "prom", "operator"):
        (tmp_path / folder).mkdir()
    pod = Stack(tmp_path / "pod", tiny_model_dir, step_s=0.01)  # the pod that does not run yet
    activator, activator_url = start_activator(tmp_path, pod.base_url)
    try:
        labels = {"namespace": NAMESPACE, "service": NAME}
        target = {activator_url.removeprefix("http://"): labels}
        prometheus = Prometheus.of_targets(tmp_path / "prom", target, metrics_path="/activator/metrics")
    except BaseException:
        activator.stop()
        raise
    spec = {
        "model": {"servedName": "tiny", "path": "/models/tiny"},
        "resources": {"gpus": 0},
        "replicas": 0,
        "autoscaling": {"mode": "builtin", "minReplicas": 0, "maxReplicas": 2, "intervalSeconds": 5},
    }
    manifest = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME}}
    loop = asyncio.new_event_loop()
    try:
        with running_operator(
            cluster, tmp_path / "operator", "--namespace", NAMESPACE, "--standalone", "--prometheus-url",
            prometheus.url, "--signal-window-s", "5",
        ):  # fmt: skip
            cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
            wait_for(lambda: cluster.apps.read_namespaced_deployment(NAME, NAMESPACE).spec.replicas == 0, 20, "zero")
            # At zero the operator routes the Service to the activator it created (played here by the process).
            assert cluster.apps.read_namespaced_deployment(f"{NAME}-activator", NAMESPACE).spec.replicas == 1
            routed = cluster.core.read_namespaced_service(NAME, NAMESPACE).spec.selector
            assert routed == identity.activator_labels(NAME)
            clients = loop.create_task(many_streams(activator_url, pod.model, CLIENTS))
            for _ in range(150):  # up to 15 s for the clients to connect on a slow, loaded machine
                loop.run_until_complete(asyncio.sleep(0.1))
                held = metric_value(
                    http("GET", f"{activator_url}/activator/metrics")[2], "overlap_activator_queued_requests"
                )
                if held == CLIENTS or clients.done():
                    break
            assert held == CLIENTS  # every client waits in the activator: no 404, no refused connection
            # The control loop reads the held requests from Prometheus and scales to one replica.
            deployment = wait_for(
                lambda: (d := cluster.apps.read_namespaced_deployment(NAME, NAMESPACE)).spec.replicas == 1 and d,
                30,
                "the operator to scale 0 -> 1",
            )
            decision = cluster.service(NAME)["status"]["lastDecision"]
            assert decision["action"] == "scale-up" and "held by the activator at zero replicas" in decision["reason"]
            # Play the kubelet: the pod starts now; its cold start is until its /readyz answers.
            started = time.monotonic()
            pod.start()
            ready_at = time.monotonic()
            cluster.play_deployment_controller(deployment.metadata.name)
            results = loop.run_until_complete(asyncio.wait_for(clients, 120))
            wait_for(
                lambda: (
                    cluster.core.read_namespaced_service(NAME, NAMESPACE).spec.selector
                    == identity.selector_labels(NAME)
                ),
                20,
                "the Service to route to the ready pod",
            )
            cluster.kubectl("delete", "inferenceservice", NAME, "-n", NAMESPACE)
    finally:
        loop.close()
        pod.stop()
        prometheus.stop()
        activator.stop()
    assert [r["status"] for r in results] == [200] * CLIENTS
    # every token of every stream came through (the last chunk carries the usage)
    assert all(r["chunks"][-1]["usage"]["completion_tokens"] == 8 for r in results)
    cold_start_s = ready_at - started
    late = [r["first_token"] - ready_at for r in results if r["first_token"] - ready_at > 1.0]
    assert not late, f"first tokens more than 1 s after the pod was ready ({cold_start_s:.1f} s cold start): {late}"


@pytest.mark.parametrize(
    ("flags", "clients", "outcome"),
    [(("--hold-timeout-s", "1"), 3, "held_too_long"), (("--max-held", "2", "--hold-timeout-s", "3"), 5, "hold_full")],
    ids=["deadline", "full"],
)
def test_what_the_activator_cannot_hold_gets_503_with_retry_after(tmp_path, flags, clients, outcome):
    nowhere = f"http://127.0.0.1:{free_port()}"
    activator, url = start_activator(tmp_path, nowhere, "--retry-after-s", "7", *flags)

    async def post() -> tuple[int, str | None, dict]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/completions", json={"prompt": "x"}) as response,
        ):
            return response.status, response.headers.get("Retry-After"), await response.json()

    async def all_posts():
        return await asyncio.gather(*(post() for _ in range(clients)))

    try:
        answers = asyncio.run(all_posts())
        metrics = http("GET", f"{url}/activator/metrics")[2]
    finally:
        activator.stop()
    refused = [a for a in answers if a[2]["error"]["code"] == outcome]
    assert refused and all(status == 503 and retry == "7" for status, retry, _ in refused)
    assert all(status == 503 for status, _, _ in answers)  # the upstream never came: nothing but 503s
    assert metric_value(metrics, "overlap_activator_requests_total", f'outcome="{outcome}"') == len(refused)
    if outcome == "hold_full":
        assert len(refused) == clients - 2  # two were held (then timed out), the rest refused at once


def test_more_held_streams_than_a_connection_pool_all_start_when_the_upstream_is_ready(tmp_path, tiny_model_dir):
    """150 held streams of 2 s: every one gets its first token before the first one ends (a pool of 100 upstream
    connections would keep 50 waiting for a whole stream)."""
    held = 150
    (tmp_path / "pod").mkdir()
    sidecar_args = ("--max-inflight", "400", "--max-queued-requests", "400")
    pod = Stack(
        tmp_path / "pod", tiny_model_dir, step_s=0.01, sidecar_args=sidecar_args, engine_args=("--max-num-seqs", "256")
    )
    activator, url = start_activator(tmp_path, pod.base_url)
    body = {"model": pod.model, "prompt": "wake up", "max_tokens": 200, "stream": True, "ignore_eos": True}

    async def one(session) -> tuple[float, float]:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            first = None
            async for line in response.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic()
            return first, time.monotonic()

    async def all_streams():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(one(session)) for _ in range(held)]
            await asyncio.sleep(0.5)  # all held: no upstream yet
            pod.start()
            return await asyncio.gather(*tasks)

    try:
        times = asyncio.run(all_streams())
    finally:
        activator.stop()
        pod.stop()
    last_first, first_end = max(t[0] for t in times), min(t[1] for t in times)
    assert last_first < first_end, f"a held stream began {last_first - first_end:.1f} s after the first one ended"


def test_scale_down_during_60_s_streams_loses_none(tmp_path, tiny_model_dir):
    """A pod removed by a scale-down gets SIGTERM after its preStop (the endpoint drain): with the grace period
    sized for the service's streams (sidecar.gracePeriodSeconds), every stream it holds runs to its last token."""
    pod = Stack(tmp_path, tiny_model_dir, step_s=0.25, sidecar_args=("--grace-period-s", "90")).start()
    streams = 20
    try:

        async def sixty_second_streams():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
                body = {"model": pod.model, "prompt": "long", "max_tokens": 240, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip

                async def one():
                    async with session.post(f"{pod.base_url}/v1/completions", json=body) as response:
                        tokens, finish = 0, None
                        async for raw in response.content:
                            line = raw.decode().strip()
                            if line.startswith("data: ") and line != "data: [DONE]":
                                chunk = json.loads(line[6:])
                                for choice in chunk["choices"]:
                                    finish = choice.get("finish_reason") or finish
                                if chunk.get("usage"):
                                    tokens = chunk["usage"]["completion_tokens"]
                        return response.status, tokens, finish

                return await asyncio.gather(*(one() for _ in range(streams)))

        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(sixty_second_streams())
            loop.run_until_complete(asyncio.sleep(5))  # the streams are 5 s into their 60 s
            started = time.monotonic()
            pod.sidecar.signal(signal.SIGTERM)  # the scale-down reaches this pod
            results = loop.run_until_complete(asyncio.wait_for(task, 120))
        finally:
            loop.close()
        exit_code = pod.sidecar.popen.wait(30)
        took = time.monotonic() - started
    finally:
        pod.stop()
    assert [status for status, _, _ in results] == [200] * streams
    assert all(tokens == 240 and finish == "length" for _, tokens, finish in results), results
    assert exit_code == 0 and took > 50  # it waited for the streams, then exited cleanly
