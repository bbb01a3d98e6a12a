"""`overlap serve --speculative-config` (docs/engine.md, "Speculative decoding") on `tiny-copy`, the tiny model's shape
wired to quote its context: a step appends several tokens, and over HTTP the text is the same streamed or not, a
stop string cuts it where it begins (the engine's extra tokens never reach the client), max_tokens holds, and
/metrics carries vLLM's spec_decode counters."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.sidecar import ADMIN_TOKEN, http, metric_value, overlap_serve

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "alpha beta gamma delta epsilon zeta " * 4 + "alpha beta"


@pytest.fixture(scope="module")
def server():
    from overlap.bench.copy_model import ensure_copy_model

    config = "num_kv_blocks: 256\nnum_threads: 1\nmax_seq_len: 512\n"
    with overlap_serve(ensure_copy_model(), "engine.yaml", config, "--speculative-config", json.dumps(SPEC)) as s:
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


def test_quoting_text_streamed_or_not_stop_strings_and_max_tokens(server):
    client = _client(server)
    body = dict(model=server["model"], prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(max_tokens=24, **body)
    text = whole.choices[0].text
    assert text.startswith(" gamma delta epsilon zeta alpha beta")  # it quotes
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(max_tokens=24, stream=True, **body))
    assert streamed == text
    stopped = client.completions.create(max_tokens=24, stop=[" zeta"], logprobs=1, **body)
    choice = stopped.choices[0]
    assert choice.text == " gamma delta epsilon" and choice.finish_reason == "stop"
    # the tokens counted and scored end with the one that completed the stop string, though a step sent more
    assert "".join(choice.logprobs.tokens) == " gamma delta epsilon zeta"
    assert stopped.usage.completion_tokens == len(choice.logprobs.tokens)
    short = client.completions.create(max_tokens=3, **body)
    assert short.usage.completion_tokens == 3 and text.startswith(short.choices[0].text)


def test_config_and_spec_decode_metrics(server):
    status, _, body = http("GET", f"{server['admin']}/admin/config",
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})  # fmt: skip
    assert status == 200 and body["config"]["speculative_config"] == SPEC
    _client(server).completions.create(model=server["model"], prompt=PROMPT, max_tokens=32, temperature=0)

    def counters():
        _, _, text = http("GET", f"{server['url']}/metrics")
        return text, {name: metric_value(text, f"vllm:spec_decode_num_{name}_total")
                      for name in ("drafts", "draft_tokens", "accepted_tokens")}  # fmt: skip

    from tests.support.sidecar import wait_until

    wait_until(lambda: (counters()[1]["drafts"] or 0) > 0, 30, "the spec_decode counters")
    text, values = counters()
    assert values["draft_tokens"] >= values["accepted_tokens"] > 0.8 * values["draft_tokens"]
    first = metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", 'position="0"')
    last = metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", 'position="3"')
    assert first >= last > 0
