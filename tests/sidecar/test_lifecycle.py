"""Sidecar behaviour around the engine, against the real EngineServer process with a scripted runner (exact tokens,
controllable step time): admin auth and live config, file watch, disconnect -> abort, engine restart, API key,
SIGTERM drain. The tests share one stack and run in file order (the last ones stop parts of it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest

from tests.support.sidecar import ADMIN_TOKEN, Stack, free_port, http, is_ready, metric_value, wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    import tempfile
    from pathlib import Path

    workdir = Path(tempfile.mkdtemp(prefix="ovl-life-"))
    s = Stack(workdir, tiny_model_dir, step_s=0.01).start()
    yield s
    s.stop()


def completion(stack, **fields) -> dict:
    return {"model": stack.model, "prompt": "hello", "max_tokens": 8, **fields}


def test_text_streams_exactly_with_multibyte_characters_and_stop_strings(stack):
    status, _, body = http("POST", f"{stack.base_url}/v1/completions", completion(stack, max_tokens=40))
    assert status == 200, body
    # The scripted runner generates the ids of this text; byte-level BPE splits its characters across tokens.
    assert body["choices"][0]["text"].startswith("héllo wörld, 日本語 and 🎉 STOP")
    status, _, body = http("POST", f"{stack.base_url}/v1/completions", completion(stack, max_tokens=40, stop=" STOP"))
    assert body["choices"][0] == {"index": 0, "text": "héllo wörld, 日本語 and 🎉", "logprobs": None,
                                  "finish_reason": "stop"}  # fmt: skip


@pytest.mark.reliability
def test_admin_needs_the_bearer_token(stack, reliability):
    url = f"{stack.admin_url}/admin/config"
    assert http("GET", url)[0] == 401
    assert http("GET", url, headers={"Authorization": "Bearer wrong-token-xxxxxxx"})[0] == 401
    assert http("GET", url, headers={"Authorization": "Bearer tést"})[0] == 401  # non-ASCII: still a clean 401
    status, _, body = http("GET", url, headers=AUTH)
    assert status == 200 and body["config"]["max_num_seqs"] == 64
    assert http("GET", f"{stack.base_url}/admin/config")[0] == 404  # never on the public port
    reliability.row(
        "Security", "the admin API without, or with a wrong or non-ASCII, bearer token",
        load="GET /admin/config on the admin port and the public one",
        outcome="401 on the admin port for each; the right token answers; 404 on the public port (never served there)",
    )  # fmt: skip


def test_the_admin_token_follows_its_file_as_kubelet_rewrites_it(stack):
    """A Secret deleted and recreated by the operator gets a new token; kubelet swaps the mounted file and the
    running sidecar takes it, so the operator's next retune reaches old pods too."""
    url = f"{stack.admin_url}/admin/config"
    rotated = "rotated-admin-token-9876543210"
    try:
        staging = stack.token_file.with_name("admin-token.new")
        staging.write_text(rotated + "\n")
        os.replace(staging, stack.token_file)  # a new inode, as kubelet's ..data swap gives
        assert http("GET", url, headers={"Authorization": f"Bearer {rotated}"})[0] == 200
        assert http("GET", url, headers=AUTH)[0] == 401  # the old token no longer opens it
        stack.token_file.write_text("")  # a broken rewrite keeps the last good token
        assert http("GET", url, headers={"Authorization": f"Bearer {rotated}"})[0] == 200
    finally:
        stack.token_file.write_text(ADMIN_TOKEN + "\n")
    assert http("GET", url, headers=AUTH)[0] == 200


def test_admin_put_applies_live_knobs_and_refuses_the_rest(stack):
    url = f"{stack.admin_url}/admin/config"
    status, _, body = http("PUT", url, {"max_num_seqs": 8, "aging_s": 2.5}, headers=AUTH)
    assert status == 200, body
    assert body["applied"] == {"max_num_seqs": 8, "aging_s": 2.5}
    assert http("GET", url, headers=AUTH)[2]["config"]["max_num_seqs"] == 8
    status, _, body = http("PUT", url, {"num_buffers": 1}, headers=AUTH)  # one knob: the others keep their values
    assert status == 200 and body["applied"] == {"num_buffers": 1}
    config = http("GET", url, headers=AUTH)[2]["config"]
    assert (config["num_buffers"], config["max_num_seqs"], config["aging_s"]) == (1, 8, 2.5)
    for bad in ({"block_size": 32}, {"max_num_seqs": 0}, {"max_num_seqs": "x"}, {}, {"num_buffers": 9}):
        status, _, body = http("PUT", url, bad, headers=AUTH)
        assert status == 400, (bad, body)
        assert body["error"]["message"]
    assert http("PUT", url, b"{not json", headers=AUTH)[0] == 400
    wait_until(lambda: metric_value(stack.metrics(), "overlap_engine_config", 'knob="max_num_seqs"') == 8, 5,
               "live config gauge")  # fmt: skip


def test_watched_config_file_applies_live_knobs(stack):
    stack.config_file.write_text(json.dumps({"max_num_seqs": 5, "default_timeout_s": 30.0, "block_size": 16}))

    def applied():
        config = http("GET", f"{stack.admin_url}/admin/config", headers=AUTH)[2]["config"]
        return config["max_num_seqs"] == 5 and config["default_timeout_s"] == 30.0

    wait_until(applied, 10, "the watched file's knobs to apply")
    http("PUT", f"{stack.admin_url}/admin/config", {"max_num_seqs": 64}, headers=AUTH)


def post_and_keep_the_socket(stack, body: dict) -> socket.socket:
    """POST a completion on a raw connection and return it unread, so the test decides when the client leaves."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", stack.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_client_disconnect_aborts_the_engine_request(stack):
    aborted_before = metric_value(stack.metrics(), "overlap_requests_finished_total", 'reason="abort"')
    for stream in (True, False):
        sock = post_and_keep_the_socket(stack, completion(stack, max_tokens=1500, ignore_eos=True, stream=stream))
        wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 1, 10, "request running")
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()  # the client goes away mid-generation
        wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 0, 5, "engine abort")
        tokens = metric_value(stack.metrics(), "overlap_engine_generation_tokens_total")
        time.sleep(0.3)  # 30 engine steps: nothing more is generated for the departed client
        assert metric_value(stack.metrics(), "overlap_engine_generation_tokens_total") == tokens
        assert tokens < 1000
    aborted = metric_value(stack.metrics(), "overlap_requests_finished_total", 'reason="abort"')
    assert aborted == aborted_before + 2


def test_request_timeout_gives_504_and_frees_the_engine(stack):
    for how in ({"timeout": 0.3}, {"headers": {"x-request-timeout": "0.3"}}):
        body = completion(stack, max_tokens=1500, ignore_eos=True, **({"timeout": 0.3} if "timeout" in how else {}))
        started = time.monotonic()
        status, _, data = http("POST", f"{stack.base_url}/v1/completions", body, headers=how.get("headers"))
        assert status == 504 and data["error"]["code"] == "timeout", data
        assert time.monotonic() - started < 5  # 1500 steps of 10 ms would take 15 s
        wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 0, 5, "engine abort")


@pytest.mark.reliability
def test_api_key_guards_the_public_api(stack, reliability):
    port = free_port()
    env = {**os.environ, "TEST_OVERLAP_KEY": "sk-test-1234"}
    proc = stack.start_sidecar("--api-key-env", "TEST_OVERLAP_KEY", port=port, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: is_ready(url), 60, "second sidecar", proc)
        body = completion(stack)
        status, _, err = http("POST", f"{url}/v1/completions", body)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        assert http("POST", f"{url}/v1/completions", body, headers={"Authorization": "Bearer nope"})[0] == 401
        status, _, ok = http("POST", f"{url}/v1/completions", body, headers={"Authorization": "Bearer sk-test-1234"})
        assert status == 200 and ok["usage"]["completion_tokens"] == 8
        assert http("GET", f"{url}/healthz")[0] == 200  # probes need no key
    finally:
        assert proc.stop() == 0
    reliability.row(
        "Security", "no or a wrong API key on the public API (--api-key-env set)", load="completions with none, a "
        "wrong and the right key", outcome="401 invalid_api_key without and with a wrong key; the right one served",
    )  # fmt: skip


def test_priority_from_body_or_header_orders_the_engine_queue(stack):
    admin = f"{stack.admin_url}/admin/config"
    assert http("PUT", admin, {"max_num_seqs": 1}, headers=AUTH)[0] == 200  # one at a time: the rest queue
    finished: list[str] = []

    def run(name: str, priority: int | None = None, headers: dict | None = None) -> None:
        body = completion(stack, max_tokens=5, ignore_eos=True)
        if priority is not None:
            body["priority"] = priority
        status, _, data = http("POST", f"{stack.base_url}/v1/completions", body, headers=headers)
        assert status == 200, data
        finished.append(name)

    # A long request holds the one slot while the others queue; its client leaves once all four wait, so the test
    # does not race a generation's length against a slow core.
    blocker = post_and_keep_the_socket(stack, completion(stack, max_tokens=1500, ignore_eos=True))
    try:
        wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 1, 10, "blocker running")
        threads = [threading.Thread(target=run, args=(f"low-{i}", 2)) for i in range(2)]
        threads += [threading.Thread(target=run, args=("high-header", None, {"x-priority": "0"})),
                    threading.Thread(target=run, args=("high-body", 0))]  # fmt: skip
        for queued, thread in enumerate(threads, 1):  # one at a time, so the arrival order is the start order
            thread.start()
            wait_until(lambda n=queued: metric_value(stack.metrics(), "vllm:num_requests_waiting") == n, 10, "queued")
        blocker.close()
        for thread in threads:
            thread.join(30)
        assert set(finished[:2]) == {"high-header", "high-body"}, finished  # overtook the earlier low ones
        assert set(finished[2:]) == {"low-0", "low-1"}
    finally:
        blocker.close()
        http("PUT", admin, {"max_num_seqs": 64}, headers=AUTH)


def test_engine_loss_fails_in_flight_requests_at_once_and_reconnects(stack):
    results = {}

    def long_request():
        started = time.monotonic()
        results["response"] = http("POST", f"{stack.base_url}/v1/completions",
                                   completion(stack, max_tokens=1500, ignore_eos=True))  # fmt: skip
        results["elapsed"] = time.monotonic() - started

    def long_stream():
        body = json.dumps(completion(stack, max_tokens=1500, ignore_eos=True, stream=True)).encode()
        request = urllib.request.Request(f"{stack.base_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            results["events"] = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]

    threads = [threading.Thread(target=long_request), threading.Thread(target=long_stream)]
    for thread in threads:
        thread.start()
    wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 2, 10, "requests running")
    stack.engine.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(10)
    status, _, body = results["response"]
    assert status == 503 and "engine" in body["error"]["message"]
    assert results["elapsed"] < 20 and time.monotonic() - killed_at < 3  # failed at once, not after 1500 steps
    *tokens, error, done = results["events"]  # the stream had begun: its end says what happened
    assert tokens and "engine" in json.loads(error[6:])["error"]["message"] and done == "data: [DONE]"
    wait_until(lambda: not is_ready(stack.base_url), 5, "readiness to go false")
    status, headers, body = http("POST", f"{stack.base_url}/v1/completions", completion(stack))
    assert status == 503 and headers["Retry-After"]
    assert metric_value(stack.metrics(), "overlap_engine_up") == 0

    stack.engine.stop()
    stack.start_engine()
    wait_until(lambda: is_ready(stack.base_url), 60, "reconnect", stack.engine)
    status, _, body = http("POST", f"{stack.base_url}/v1/completions", completion(stack))
    assert status == 200 and body["usage"]["completion_tokens"] == 8


def test_sigterm_cuts_off_requests_that_outlive_the_grace_period(stack):
    port = free_port()
    proc = stack.start_sidecar("--grace-period-s", "1", port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: is_ready(url), 60, "second sidecar", proc)
        body = completion(stack, max_tokens=1500, ignore_eos=True)  # 1500 steps of 10 ms: 15 s
        outcome = {}

        def long_request():
            try:
                outcome["status"] = http("POST", f"{url}/v1/completions", body)[0]
            except OSError as exc:  # the connection closes under it: that is the cut-off
                outcome["error"] = exc

        thread = threading.Thread(target=long_request, daemon=True)
        thread.start()
        wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 1, 10, "request running")
        started = time.monotonic()
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(12) == 0
        assert time.monotonic() - started < 8  # 1 s of grace, then cancelled (waiting for it would take ~15 s)
        thread.join(5)
        assert "status" not in outcome or outcome["status"] >= 500, outcome
        # The cut-off request was aborted in the engine, not left running.
        wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 0, 5, "engine abort")
    finally:
        proc.stop()


def test_sigterm_drains_in_flight_requests_then_exits(stack):
    results = {}

    def long_request():
        results["response"] = http("POST", f"{stack.base_url}/v1/completions",
                                   completion(stack, max_tokens=200, ignore_eos=True))  # fmt: skip

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(lambda: metric_value(stack.metrics(), "vllm:num_requests_running") == 1, 10, "request running")
    alive = stack.alive_file()
    assert alive.read_text().strip() == str(stack.sidecar.popen.pid)  # what a pod's engine preStop waits on
    stack.sidecar.signal(signal.SIGTERM)
    wait_until(lambda: http("GET", f"{stack.base_url}/readyz")[0] == 503, 5, "readiness false while draining")
    status, _, body = http("POST", f"{stack.base_url}/v1/completions", completion(stack))
    assert status == 503 and body["error"]["code"] == "draining"
    assert alive.exists()  # still draining: the engine must stay
    thread.join(30)
    status, _, body = results["response"]
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 200
    assert stack.sidecar.popen.wait(30) == 0
    assert not alive.exists()  # drained and stopped: the engine may go
