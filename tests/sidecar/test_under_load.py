"""Faults under load against the real sidecar and EngineServer processes (a scripted runner, no torch), each a row of
the reliability suite: a storm of streams that all leave mid-generation frees the engine at once; SIGTERM to the
sidecar finishes every request in flight; the engine killed fails every request in flight at once with a clear
error, and the sidecar serves again when it is back. The tests share one stack and run in file order."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from overlap.engine.serving.client import EngineClient
from tests.support.sidecar import Stack, http, is_ready, metric_value, wait_until

STORM = 1000
LOAD = 64  # a full running batch of the engine's default max_num_seqs
# The target is 1 s. On an AVX2 EPYC the first abort sometimes reaches the engine only 0.4-0.8 s after the
# clients left, whatever the token rate, and the engine is free 1.2-1.8 s after; the cause is not found yet
# (docs/reliability.md). The bound keeps the regression it guards: without the aborts the engine runs 300 s on.
FREED_BOUND_S = 2.0
SLOW_TIMEOUT_S = 2  # the sidecar's idle and body timeouts here (60 s and 30 s by default)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    workdir = Path(tempfile.mkdtemp(prefix="ovl-storm-"))
    # Room for every stream in the running batch and its KV, so each one is really mid-generation when it leaves.
    # A 200 ms step: 5k tokens/s to stream. Faster, the sidecar's one core falls behind on the slower machines (an
    # AVX2 EPYC streams under 20k tokens/s) and the disconnects queue behind token deliveries (docs/reliability.md).
    s = Stack(
        workdir, tiny_model_dir, step_s=0.2,
        sidecar_args=("--max-inflight", str(2 * STORM), "--max-queued-requests", str(2 * STORM),
                      "--idle-timeout-s", str(SLOW_TIMEOUT_S), "--body-timeout-s", str(SLOW_TIMEOUT_S)),
        engine_args=("--max-num-seqs", str(STORM + 24), "--num-kv-blocks", "65536"),
    ).start()  # fmt: skip
    yield s
    s.stop()


@contextlib.asynccontextmanager
async def _engine_connection(stack: Stack):
    """A second connection to the engine, to read its own counters (not the sidecar's polled copy)."""
    engine = EngineClient(str(stack.socket))
    task = asyncio.create_task(engine.run())
    try:
        await engine.wait_connected(10)
        yield engine
    finally:
        task.cancel()


async def _storm(stack: Stack, clients: int) -> dict:
    async with _engine_connection(stack) as engine:
        return await _storm_on(stack, engine, clients)


async def _storm_on(stack: Stack, engine: EngineClient, clients: int) -> dict:
    before = await engine.stats()
    body = {"model": stack.model, "prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    started: list[aiohttp.ClientResponse] = []
    all_started = asyncio.Event()

    async def one(session: aiohttp.ClientSession) -> None:
        response = await session.post(f"{stack.base_url}/v1/completions", json=body)
        assert response.status == 200, await response.text()
        async for line in response.content:  # up to the first token's event
            if line.startswith(b"data: "):
                break
        started.append(response)
        if len(started) == clients:
            all_started.set()

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(clients)]
        await asyncio.wait_for(all_started.wait(), 90)
        running = (await engine.stats())["num_running"]
        left_at = time.monotonic()
        for response in started:  # every client goes at once, mid-stream
            response.connection.transport.abort()
            response.close()
        while True:
            stats = await engine.stats()
            if (
                stats["num_running"] == stats["num_waiting"] == 0
                and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            ):
                freed_s = time.monotonic() - left_at
                break
            if time.monotonic() - left_at > 10:
                raise AssertionError(f"10 s after the clients left the engine still has {stats}")
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
    aborted = stats["requests_finished_total"]["abort"] - before["requests_finished_total"]["abort"]
    return {"running": running, "freed_s": freed_s, "aborted": aborted}


@pytest.mark.reliability
@pytest.mark.slow
def test_a_storm_of_streams_that_leave_mid_generation_frees_the_engine_at_once(stack, reliability):
    result = asyncio.run(_storm(stack, STORM))
    print(f"{STORM} streams left mid-generation ({result['running']} running): engine idle with every KV block back "
          f"{result['freed_s']:.2f} s later")  # fmt: skip
    assert result["running"] == STORM  # all of them were generating, none still queued
    assert result["freed_s"] <= FREED_BOUND_S
    assert result["aborted"] == STORM
    reliability.row(
        "Sidecar", f"{STORM} streaming clients disconnect at once, mid-generation",
        load=f"{STORM} streams of 1500 tokens, all in the running batch", accepted=STORM, answered=result["aborted"],
        outcome=f"each aborted in the engine; no request running and every KV block back {result['freed_s']:.2f} s "
        f"after they left (bound {FREED_BOUND_S:g} s; the target is 1 s)",
    )  # fmt: skip


@pytest.mark.reliability
def test_slow_clients_are_cut_off_by_the_timeouts_and_leave_nothing_behind(stack, reliability):
    """100 clients that trickle their headers and 100 that send headers, then part of the body: the first are closed
    after the idle timeout, the others get a 408 after the body timeout; the sidecar's sockets and requests go back
    to what they were, and it serves meanwhile."""
    pid = stack.sidecar.popen.pid
    fds_before = len(os.listdir(f"/proc/{pid}/fd"))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    socks = []
    for i in range(200):
        sock = socket.create_connection(("127.0.0.1", stack.port))
        sock.sendall(head[:20] if i < 100 else head + b'Content-Length: 500\r\n\r\n{"prompt": ')
        sock.settimeout(SLOW_TIMEOUT_S + 10)
        socks.append(sock)
    opened = time.monotonic()
    status, _, body = http("POST", f"{stack.base_url}/v1/completions", {"model": stack.model, "prompt": "hi"})
    assert status == 200, body  # served while 200 slow clients hang on
    answers = []
    for sock in socks:
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
            if b"\r\n\r\n" in data and b'"code"' in data:
                break
        answers.append((data.split(b"\r\n", 1)[0], time.monotonic() - opened))
        sock.close()
    closed = [t for line, t in answers[:100] if line == b""]
    timed_out = [t for line, t in answers[100:] if line.startswith(b"HTTP/1.1 408")]
    assert len(closed) == 100 and max(closed) < SLOW_TIMEOUT_S + 3, answers[:3]
    assert len(timed_out) == 100 and max(timed_out) < SLOW_TIMEOUT_S + 3, answers[100:103]
    wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= fds_before + 2, 10, "the sidecar's sockets closed")
    wait_until(lambda: metric_value(stack.metrics(), "overlap_sidecar_inflight_requests") == 0, 5, "nothing in flight")
    reliability.row(
        "Sidecar", "slow clients: 100 trickle their headers, 100 their body",
        load="200 connections held open, one completion served meanwhile",
        outcome=f"header ones closed after the idle timeout ({max(closed):.1f} s), body ones 408 after the body "
        f"timeout ({max(timed_out):.1f} s; both {SLOW_TIMEOUT_S} s here, 60 s and 30 s by default); sockets and "
        "in-flight count back to before",
        accepted=1, answered=1,
    )  # fmt: skip


@pytest.mark.reliability
def test_hostile_bodies_get_a_clear_4xx_and_the_sidecar_serves_on(stack, reliability):
    model = stack.model.encode()
    bodies = {
        "a lone surrogate in a prompt": (b'{"model": "%s", "prompt": "a\\ud800b"}' % model, 400),
        "a lone surrogate in a stop string": (b'{"model": "%s", "prompt": "a", "stop": ["\\udfff"]}' % model, 400),
        "invalid UTF-8 in a prompt": (b'{"model": "%s", "prompt": "a\xff"}' % model, 400),
        "100k levels of nesting": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        "a 3 MiB body": (b'{"prompt": "' + b"a" * (3 << 20) + b'"}', 413),
        "not JSON": (b"\x00\x01{{{", 400),
    }
    for what, (body, expected) in bodies.items():
        status, _, answer = http("POST", f"{stack.base_url}/v1/completions", body)
        assert status == expected and answer["error"]["message"], (what, status, answer)
    status, _, answer = http("POST", f"{stack.base_url}/v1/completions", {"model": stack.model, "prompt": "hi"})
    assert status == 200, answer
    reliability.row(
        "Sidecar", "hostile bodies: " + ", ".join(bodies), load="one request each, then a good one",
        outcome="each an OpenAI error (400, 413 for the size) naming the problem, never a 5xx; the good one served",
        accepted=1, answered=1,
    )  # fmt: skip


async def _engine_running(stack: Stack, wanted: int, timeout: float = 30) -> None:
    """Wait until the engine itself runs `wanted` requests."""
    async with _engine_connection(stack) as engine, asyncio.timeout(timeout):
        while (await engine.stats())["num_running"] < wanted:
            await asyncio.sleep(0.02)


async def _request(session: aiohttp.ClientSession, stack: Stack, stream: bool, max_tokens: int) -> dict:
    """One completion, streamed or not: its status, tokens, the error it ended with, and when it ended."""
    body = {"model": stack.model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}  # fmt: skip
    result = {"status": None, "tokens": 0, "error": None, "ended": None}
    try:
        async with session.post(f"{stack.base_url}/v1/completions", json=body) as response:
            result["status"] = response.status
            if not stream or response.status != 200:  # a stream refused or failed before it began is JSON too
                data = await response.json()
                result["tokens"] = (data.get("usage") or {}).get("completion_tokens", 0)
                result["error"] = (data.get("error") or {}).get("message")
            else:
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result["error"] = event["error"]["message"]
                    elif event.get("usage"):
                        result["tokens"] = event["usage"]["completion_tokens"]
    except aiohttp.ClientError as exc:
        result["error"] = f"connection: {exc!r}"
    result["ended"] = time.monotonic()
    return result


async def _load_then(stack: Stack, max_tokens: int, fault=None) -> tuple[list[dict], float]:
    """LOAD requests (half streamed); with a `fault`, once the engine runs them all, `fault()`. Every result and
    when the fault came."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(_request(session, stack, i % 2 == 0, max_tokens)) for i in range(LOAD)]
        if fault is not None:
            await _engine_running(stack, LOAD)
        faulted_at = time.monotonic()
        if fault is not None:
            fault()
        return await asyncio.gather(*tasks), faulted_at


SIGTERM_TOKENS = 40


@pytest.mark.reliability
def test_sigterm_to_the_sidecar_under_load_finishes_every_request_in_flight(stack, reliability):
    refused: list[int] = []

    def sigterm():
        stack.sidecar.signal(signal.SIGTERM)
        wait_until(lambda: http("GET", f"{stack.base_url}/readyz")[0] == 503, 5, "readiness off while draining")
        refused.append(http("POST", f"{stack.base_url}/v1/completions", {"model": stack.model, "prompt": "x"})[0])

    # 40 tokens at the module's 200 ms step: 8 s of work left, well inside the 20 s grace period
    results, signalled_at = asyncio.run(_load_then(stack, SIGTERM_TOKENS, sigterm))
    assert stack.sidecar.popen.wait(30) == 0
    exited_s = time.monotonic() - signalled_at
    finished = [r for r in results if r["status"] == 200 and r["tokens"] == SIGTERM_TOKENS and not r["error"]]
    assert len(finished) == LOAD, [r for r in results if r not in finished][:3]
    assert refused == [503]  # a new request while draining is refused, never half-served
    stack.start_sidecar()
    wait_until(lambda: is_ready(stack.base_url), 60, "the sidecar back", stack.sidecar)
    reliability.row(
        "Sidecar", "SIGTERM to the sidecar during load",
        load=f"{LOAD} requests of {SIGTERM_TOKENS} tokens (half streamed) in the running batch",
        outcome=f"readiness off at once, a new request 503 draining; all {LOAD} finished with every token, then it "
        f"exited 0 ({exited_s:.1f} s after the signal; grace period 20 s)",
        accepted=LOAD, answered=len(finished),
    )  # fmt: skip


@pytest.mark.reliability
def test_the_engine_killed_under_load_fails_every_request_at_once_and_serving_resumes(stack, reliability):
    results, killed_at = asyncio.run(_load_then(stack, 1500, lambda: stack.engine.signal(signal.SIGKILL)))
    clear = [r for r in results if r["error"] and "engine" in r["error"] and r["status"] in (200, 503)]
    assert len(clear) == LOAD, [r for r in results if r not in clear][:3]  # 200: a stream that had begun
    failed_within_s = max(r["ended"] for r in results) - killed_at
    assert failed_within_s < 3  # at once, not after 1500 steps
    wait_until(lambda: not is_ready(stack.base_url), 5, "readiness to go false")
    status, headers, _ = http("POST", f"{stack.base_url}/v1/completions", {"model": stack.model, "prompt": "x"})
    assert status == 503 and headers["Retry-After"]
    stack.engine.stop()
    stack.start_engine()
    wait_until(lambda: is_ready(stack.base_url), 60, "the sidecar to reconnect", stack.engine)
    after, _ = asyncio.run(_load_then(stack, 20))
    assert all(r["status"] == 200 and r["tokens"] == 20 for r in after)
    reliability.row(
        "Sidecar", "the engine process killed (SIGKILL) during load",
        load=f"{LOAD} requests of 1500 tokens (half streamed) in the running batch",
        outcome=f"every one failed with a clear engine error within {failed_within_s:.2f} s (503, or an error event "
        f"ending a begun stream); readiness off, 503 with Retry-After; once the engine was back, {LOAD} more served",
        accepted=2 * LOAD, answered=len(clear) + len(after),
    )  # fmt: skip
