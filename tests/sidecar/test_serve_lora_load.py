"""LoRA adapters under load (issue 52) through a real `overlap serve --enable-lora --max-loras 2`: 64 streams, each
naming the base model or one of three adapters, while adapters are loaded and unloaded in a loop. Every stream ends
with its full max_tokens and its adapter's greedy text (the reference: the same server, one request at a time, before
the load), including the streams of an adapter unloaded while they run or wait. A request for the adapter that comes
and goes gets its text while it is loaded and 404 while it is not, nothing else."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.support.lora import make_adapter

PROMPTS = [[5, 17, 300, 42, 9, 1200, 77], [88, 3, 410, 12], [900, 901, 2, 33, 61, 7, 250, 14, 5], [64, 1000, 8]]
NEW_TOKENS = 16
STREAMS = 64
CHURN_ROUNDS = 6  # load and unload of the adapter that comes and goes
RACERS = 8  # requests for it sent around each unload
RACE_STEP_S = 0.003


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("load-adapters")
    return {
        "a": make_adapter(tiny_model_dir, root / "a", 8, 16, False, ["q_proj", "v_proj", "down_proj"], seed=11),
        "b": make_adapter(tiny_model_dir, root / "b", 4, 8, True, ["k_proj", "o_proj", "up_proj"], seed=12),
        "c": make_adapter(
            tiny_model_dir, root / "c", 2, 4, False, ["q_proj", "gate_proj", "down_proj"], seed=13, spread=0.1
        ),
        "d": make_adapter(tiny_model_dir, root / "d", 8, 8, False, ["v_proj", "o_proj", "down_proj"], seed=14),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    from tests.support.sidecar import overlap_serve

    # Two slots for four adapters: slots are refilled under load; KV room for every stream at once.
    config = "num_kv_blocks: 512\nnum_threads: 1\nmax_seq_len: 128\n"
    flags = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}",
             f"b={adapters['b']}", "--allow-runtime-lora-updating", "true")  # fmt: skip
    with overlap_serve(tiny_model_dir, "engine.yaml", config, *flags) as s:
        yield s


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, str]:
    async with session.post(url, json=body) as response:
        return response.status, await response.text()


async def _load(session, server, name: str, path) -> None:
    status, text = await _post(session, f"{server['url']}/v1/load_lora_adapter", {"lora_name": name,
                                                                                 "lora_path": str(path)})  # fmt: skip
    assert status == 200, text


async def _unload(session, server, name: str) -> None:
    status, text = await _post(session, f"{server['url']}/v1/unload_lora_adapter", {"lora_name": name})
    assert status == 200, text


def _body(model: str, prompt: list[int], stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


async def _stream(session, server, model: str, prompt: list[int], first_token: asyncio.Event | None = None):
    """(status, text, completion tokens, finish reason) of one streamed completion; the error body if refused."""
    async with session.post(f"{server['url']}/v1/completions", json=_body(model, prompt, True)) as response:
        if response.status != 200:
            return response.status, await response.text(), 0, None
        text, tokens, finish = "", 0, None
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                if first_token is not None:
                    first_token.set()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        return 200, text, tokens, finish


async def _references(session, server, adapters) -> dict[tuple[str, int], str]:
    await _load(session, server, "c", adapters["c"])
    await _load(session, server, "d", adapters["d"])
    refs = {}
    for model in (server["model"], "a", "b", "c", "d"):
        for p, prompt in enumerate(PROMPTS):
            status, text = await _post(session, f"{server['url']}/v1/completions", _body(model, prompt, False))
            assert status == 200, text
            out = json.loads(text)
            assert out["usage"]["completion_tokens"] == NEW_TOKENS
            refs[model, p] = out["choices"][0]["text"]
    await _unload(session, server, "d")
    for p in range(len(PROMPTS)):  # the adapters really differ from each other and from the base
        texts = [refs[m, p] for m in (server["model"], "a", "b", "c", "d")]
        assert len(set(texts)) == 5, texts
    return refs


async def _later(delay: float, work):
    await asyncio.sleep(delay)
    return await work


async def _churn(session, server, adapters, c_started: asyncio.Event) -> tuple[list, list, list]:
    """Unload c once one of its streams runs; then load and unload d, asking for it while loaded, around the unload
    and after: each answer as (prompt index, status, text, tokens, finish reason)."""
    await asyncio.wait_for(c_started.wait(), 60)
    await _unload(session, server, "c")
    loaded, racing, unloaded = [], [], []
    for round_ in range(CHURN_ROUNDS):
        prompt = round_ % len(PROMPTS)
        await _load(session, server, "d", adapters["d"])
        loaded.append((prompt, *await _stream(session, server, "d", PROMPTS[prompt])))
        # Requests sent around the unload, a few ms apart: each reaches the engine before it (served) or after it
        # (refused as the sidecar refuses a name it no longer lists, even when the sidecar's check let it in).
        racers = [_later(i * RACE_STEP_S, _stream(session, server, "d", PROMPTS[prompt])) for i in range(RACERS)]
        *raced, _ = await asyncio.gather(*racers, _later(RACERS / 2 * RACE_STEP_S, _unload(session, server, "d")))
        racing += [(prompt, *answer) for answer in raced]
        unloaded.append((prompt, *await _stream(session, server, "d", PROMPTS[prompt])))
    return loaded, racing, unloaded


async def test_streams_keep_their_adapters_while_adapters_come_and_go(server, adapters):
    base = server["model"]
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        refs = await _references(session, server, adapters)
        models = [base, "a", "b", "c"]
        plan = [(models[i % len(models)], i % len(PROMPTS)) for i in range(STREAMS)]
        c_started = asyncio.Event()
        streams = [_stream(session, server, model, PROMPTS[p], c_started if model == "c" else None)
                   for model, p in plan]  # fmt: skip
        *results, churned = await asyncio.gather(*streams, _churn(session, server, adapters, c_started))

    for (model, p), (status, text, tokens, finish) in zip(plan, results, strict=True):
        assert status == 200, (model, text)
        assert (tokens, finish) == (NEW_TOKENS, "length"), (model, p, tokens, finish)
        assert text == refs[model, p], (model, p)
    loaded, racing, unloaded = churned
    for p, status, text, tokens, _ in loaded:
        assert (status, tokens, text) == (200, NEW_TOKENS, refs["d", p])
    for p, status, text, tokens, _ in racing:
        if status == 200:
            assert (tokens, text) == (NEW_TOKENS, refs["d", p])
        else:
            assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found", text
    for _, status, text, _, _ in unloaded:
        assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found", text
