"""`overlap serve` end to end (the real engine process, the real tiny model, the sidecar process) driven by the
official `openai` client, sync and async; plus every kind of bad input, the OpenAPI document, `promtool check
metrics`, and the printed `curl` line. One server for the whole module."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import openai
import pytest

from tests.support.debian import ensure_prometheus
from tests.support.sidecar import ADMIN_TOKEN, http, is_ready, metric_value, overlap_serve, wait_until

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = json.dumps({"num_kv_blocks": 512, "max_num_seqs": 16, "num_threads": 1})
    with overlap_serve(tiny_model_dir, "engine.json", config, also_ready=lambda proc: "curl" in proc.output()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- the happy paths -------------------------------------------------------------------------------------------


def test_models(client, server):
    assert [m.id for m in client.models.list().data] == [server["model"]]


def test_completion_streamed_equals_unstreamed(client, server):
    kwargs = dict(model=server["model"], prompt="The meaning of life is", max_tokens=12, **GREEDY)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens > 0 and 1 <= full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert client.completions.create(**kwargs).choices[0].text == choice.text  # greedy is deterministic

    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_ignore_eos_gives_exactly_max_tokens_and_seed_reproduces(client, server):
    kwargs = dict(model=server["model"], prompt=[5, 6, 7, 8], max_tokens=24, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kwargs)
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == 4 and a.choices[0].finish_reason == "length"
    assert client.completions.create(**kwargs).choices[0].text == a.choices[0].text


def test_stop_string_cuts_the_text(client, server):
    kwargs = dict(model=server["model"], prompt="Once upon a time", max_tokens=30, extra_body={"ignore_eos": True},
                  **GREEDY)  # fmt: skip
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip(f"no usable stop string in {text!r}")
    stopped = client.completions.create(**kwargs, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


async def test_async_chat_streamed_and_not(aclient, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    kwargs = dict(model=server["model"], messages=messages, max_completion_tokens=10, **GREEDY)
    full = await aclient.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens <= 10

    stream = await aclient.chat.completions.create(**kwargs, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    say_hello = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": say_hello},
    ]
    as_parts = await aclient.chat.completions.create(**{**kwargs, "messages": parts})
    assert as_parts.choices[0].message.content == message.content


async def test_async_completions_concurrently(aclient, server):
    import asyncio

    async def one(i):
        return await aclient.completions.create(model=server["model"], prompt=f"Number {i}", max_tokens=8,
                                                extra_body={"ignore_eos": True, "priority": i % 3})  # fmt: skip

    results = await asyncio.gather(*(one(i) for i in range(12)))
    assert all(r.usage.completion_tokens == 8 for r in results)


def test_sync_chat_stream_with_usage(client, server):
    stream = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


# ---- bad input: always a 4xx with a message, never a 5xx or a hang ---------------------------------------------


def _bad_cases(model: str) -> list[tuple[str, str, bytes | dict, int, dict]]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"model": model, "prompt": "hi", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("malformed JSON", c, b'{"model": "x", "prompt": ', 400, {}),
        ("JSON that is not an object", c, b"[1, 2, 3]", 400, {}),
        ("empty body", c, b"", 400, {}),
        ("JSON nested too deeply", c, b'{"model": "m", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, {}),
        ("NaN", c, b'{"model": "' + model.encode() + b'", "prompt": "x", "temperature": NaN}', 400, {}),
        ("invalid UTF-8", c, b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe"}', 400, {}),
        ("max_tokens of the wrong type", c, {**ok, "max_tokens": "ten"}, 400, {}),
        ("temperature of the wrong type", c, {**ok, "temperature": "hot"}, 400, {}),
        ("prompt of the wrong type", c, {**ok, "prompt": 5}, 400, {}),
        ("messages of the wrong type", ch, {**chat, "messages": "hi"}, 400, {}),
        ("missing model", c, {"prompt": "hi"}, 400, {}),
        ("missing prompt", c, {"model": model}, 400, {}),
        ("missing messages", ch, {"model": model}, 400, {}),
        ("negative max_tokens", c, {**ok, "max_tokens": -1}, 400, {}),
        ("zero max_tokens", c, {**ok, "max_tokens": 0}, 400, {}),
        ("huge max_tokens", c, {**ok, "max_tokens": 10**9}, 400, {}),
        ("max_tokens beyond int64", c, {**ok, "max_tokens": 10**30}, 400, {}),
        ("prompt over the context length", c, {**ok, "prompt": [5] * 5000}, 400, {}),
        ("long text over the context length", c, {**ok, "prompt": "word " * 20000}, 400, {}),
        ("token id outside the vocabulary", c, {**ok, "prompt": [5, 10**7]}, 400, {}),
        ("empty prompt", c, {**ok, "prompt": ""}, 400, {}),
        ("too many prompts", c, {**ok, "prompt": ["a"] * 65}, 400, {}),
        ("unknown model", c, {**ok, "model": "gpt-9"}, 404, {}),
        ("body over 1 MiB", c, {**ok, "prompt": "a" * (1024 * 1024 + 10)}, 413, {}),
        ("unknown field", c, {**ok, "max_token": 5}, 400, {}),
        ("n over the cap", c, {**ok, "n": 17}, 400, {}),
        ("best_of < n", c, {**ok, "n": 2, "best_of": 1}, 400, {}),
        ("best_of streamed", c, {**ok, "n": 1, "best_of": 2, "stream": True}, 400, {}),
        ("logprobs over 20", c, {**ok, "logprobs": 21}, 400, {}),
        ("negative temperature", c, {**ok, "temperature": -1}, 400, {}),
        ("top_p of 0", c, {**ok, "top_p": 0}, 400, {}),
        ("negative top_k", c, {**ok, "top_k": -5}, 400, {}),
        ("too many stop strings", c, {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, {}),
        ("a stop string over 1024 characters", c, {**ok, "stop": "x" * 1025}, 400, {}),
        ("too many bad_words", c, {**ok, "bad_words": ["w"] * 257}, 400, {}),
        ("priority out of range", c, {**ok, "priority": 7}, 400, {}),
        ("x-priority not a number", c, ok, 400, {"x-priority": "high"}),
        ("negative timeout", c, {**ok, "timeout": -1}, 400, {}),
        ("empty messages", ch, {**chat, "messages": []}, 400, {}),
        ("unknown role", ch, {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400, {}),
        ("image content part", ch, {**chat, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, {}),
        ("tools", ch, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, {}),
        ("tool_choice naming a list", ch, {**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
                                           "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, 400, {}),
        ("tool_calls with a null function", ch, {**chat, "messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": None}]},
            {"role": "user", "content": "hi"}]}, 400, {}),
        ("logit_bias key not a token id", c, {**ok, "logit_bias": {"\u00b2": 1}}, 400, {}),
        ("seed past 64 bits", c, {**ok, "seed": 2**64}, 400, {}),
        ("top_k past 64 bits", c, {**ok, "top_k": 2**70}, 400, {}),
        ("guided_json nested too deep", c, {**ok, "guided_json": "[" * 5000 + "]" * 5000}, 400, {}),
        ("chat over the context length", ch, {**chat, "max_tokens": 10**6}, 400, {}),
    ]  # fmt: skip


def test_bad_inputs_get_the_right_4xx(server):
    failures = []
    for name, path, body, expected, headers in _bad_cases(server["model"]):
        started = time.monotonic()
        status, _, data = http("POST", server["url"] + path, body, headers=headers, timeout=30)
        elapsed = time.monotonic() - started
        message = data.get("error", {}).get("message") if isinstance(data, dict) else None
        if status != expected or not message or elapsed > 10:
            failures.append(f"{name}: {status} in {elapsed:.1f}s, {data!r:.200}")
    status, _, data = http("GET", f"{server['url']}/v1/kv-events?since={2**70}")
    if status != 400:
        failures.append(f"kv-events since past 64 bits: {status}, {data!r:.200}")
    assert not failures, "\n".join(failures)
    assert is_ready(server["url"])  # and the server is still fine
    invalid = metric_value(http("GET", f"{server['url']}/metrics")[2], "overlap_requests_rejected_total",
                           'reason="invalid"')  # fmt: skip
    assert invalid >= len(_bad_cases(server["model"]))


def test_fields_openai_marks_nullable_take_null_as_their_default(server):
    """Clients that send every field send null for the ones they leave unset: `n`, `stream`, `echo`, `logprobs`."""
    model = server["model"]
    chat = {"messages": [{"role": "user", "content": "Hello"}], "logprobs": None}
    for path, body in (("/v1/completions", {"prompt": "Hello", "echo": None, "logprobs": None}),
                       ("/v1/chat/completions", chat)):  # fmt: skip
        status, _, data = http("POST", server["url"] + path,
                               {"model": model, "max_tokens": 3, "n": None, "stream": None, **body})  # fmt: skip
        assert status == 200 and len(data["choices"]) == 1, data
        assert data["choices"][0].get("logprobs") is None


def test_wrong_methods_and_routes_get_openai_errors(server):
    status, _, data = http("GET", f"{server['url']}/v1/completions")
    assert status == 405 and data["error"]["message"]
    status, _, data = http("GET", f"{server['url']}/v2/nothing")
    assert status == 404 and data["error"]["type"] == "not_found_error"


def test_openai_client_raises_typed_errors(client, server):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=server["model"], prompt="x", max_tokens=10**6)


# ---- operations ------------------------------------------------------------------------------------------------


def test_health_endpoints(server):
    for path in ("/health", "/healthz", "/readyz", "/ping"):
        assert http("GET", server["url"] + path)[0] == 200
    status, _, body = http("POST", server["url"] + "/ping", {})  # SageMaker probes with POST
    assert status == 200 and body["ready"] is True


def test_tokenize_detokenize_and_version_in_vllms_shapes(server, tiny_model_dir):
    from importlib.metadata import version

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The meaning of life is"
    status, _, body = http("POST", f"{server['url']}/tokenize",
                           {"model": server["model"], "prompt": text, "return_token_strs": True})  # fmt: skip
    assert status == 200 and body["tokens"] == tokenizer(text).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    messages = [{"role": "user", "content": "hi"}]
    status, _, chat = http("POST", f"{server['url']}/tokenize", {"messages": messages})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert status == 200 and chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    status, _, back = http("POST", f"{server['url']}/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == text
    status, _, ver = http("GET", f"{server['url']}/version")
    assert status == 200 and ver["version"] == version("overlap-sidecar")
    bad_cases = [("/tokenize", {"prompt": "x", "messages": messages}), ("/tokenize", {}),
                 ("/detokenize", {"tokens": [10**9]}), ("/tokenize", {"prompt": "x", "model": "gpt-9"})]  # fmt: skip
    for path, bad in bad_cases:
        status, _, err = http("POST", f"{server['url']}{path}", bad)
        assert status in (400, 404) and err["error"]["message"], (path, bad, err)


def test_openapi_describes_every_route(server):
    status, _, doc = http("GET", f"{server['url']}/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    expected = {("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models"),
                ("get", "/health"), ("get", "/healthz"), ("get", "/readyz"), ("get", "/metrics"),
                ("get", "/openapi.json"), ("post", "/tokenize"), ("post", "/detokenize"),
                ("get", "/version"), ("get", "/ping"), ("post", "/ping"), ("get", "/v1/kv-events"),
                ("get", "/v1/tokenizer"), ("post", "/v1/load_lora_adapter"),
                ("post", "/v1/unload_lora_adapter")}  # fmt: skip
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == expected
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")
    assert "max_tokens" in doc["components"]["schemas"]["CompletionRequest"]["properties"]


def test_metrics_pass_promtool_and_carry_the_series(client, server):
    ensure_prometheus()
    client.completions.create(model=server["model"], prompt="warm", max_tokens=4)
    time.sleep(1.0)  # one stats poll
    status, _, text = http("GET", f"{server['url']}/metrics")
    assert status == 200
    check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True)
    report = (check.stdout + check.stderr).decode()
    # promtool parses everything (exit 1 would be a parse error). Its lint objects to ':' in names, which the three
    # `vllm:` series of the Gateway API inference extension's model-server protocol must have; any other finding
    # fails the test.
    findings = [line for line in report.splitlines() if line.strip()]
    mandated = {f"{name} metric names should not contain ':'" for name in
                ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")}  # fmt: skip
    assert check.returncode in (0, 3) and set(findings) <= mandated, report
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "overlap_request_queue_time_seconds_bucket", "overlap_request_prefill_time_seconds_bucket",
                 "overlap_time_to_first_token_seconds_bucket", "overlap_inter_token_latency_seconds_bucket",
                 "overlap_e2e_request_latency_seconds_bucket", "overlap_prompt_tokens_total",
                 "overlap_generation_tokens_total", "overlap_requests_rejected_total", "overlap_preemptions_total",
                 "overlap_step_time_seconds", "overlap_batch_size", "overlap_device_busy_ratio",
                 "overlap_prefix_cache_hit_rate", "overlap_queue_depth", "overlap_engine_config",
                 "overlap_engine_up 1.0"):  # fmt: skip
        assert name in text, name


def test_live_config_through_serve_admin_port(server):
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    status, _, body = http("PUT", f"{server['admin']}/admin/config", {"max_num_seqs": 12}, headers=auth)
    assert status == 200 and body["applied"] == {"max_num_seqs": 12}


def test_printed_curl_line_works(server):
    line = next(line.strip() for line in server["proc"].output().splitlines() if line.strip().startswith("curl "))
    result = subprocess.run(shlex.split(line), capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["object"] == "text_completion" and data["usage"]["completion_tokens"] >= 1


def test_serve_restarts_a_dead_engine_and_the_sidecar_reconnects(client, server):
    proc = server["proc"]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    engine = next(pid for pid in children if b"engine" in Path(f"/proc/{pid}/cmdline").read_bytes())
    subprocess.run(["kill", "-KILL", engine], check=True)
    wait_until(lambda: not is_ready(server["url"]), 10, "readiness false without the engine")
    wait_until(lambda: is_ready(server["url"]), 120, "the restarted engine", proc)
    again = client.completions.create(model=server["model"], prompt="back", max_tokens=3)
    assert again.usage.completion_tokens >= 1


def test_serve_stops_both_processes(tiny_model_dir, server):
    """Last: SIGTERM to `overlap serve` drains and stops the sidecar and the engine (no orphans)."""
    proc = server["proc"]
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2, children
    assert proc.stop(60) == 0
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
