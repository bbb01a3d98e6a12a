"""LoRA adapters through `overlap serve` with vLLM's flags and routes: --enable-lora --lora-modules, adapters listed
in /v1/models with their parent, the request's `model` picking the adapter (tokens equal to transformers + PEFT),
POST /v1/load_lora_adapter and /v1/unload_lora_adapter with runtime updating allowed (and refused without it),
`vllm:lora_requests_info` in /metrics."""

from __future__ import annotations

import pytest

from tests.support.lora import make_adapter, peft_greedy
from tests.support.sidecar import http, overlap_serve, wait_until

PROMPT = [5, 17, 300, 42, 9, 1200, 77]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("serve-adapters")
    return {
        "sql": make_adapter(tiny_model_dir, root / "sql", 8, 16, False, ["q_proj", "v_proj", "down_proj"], seed=1),
        "chat": make_adapter(tiny_model_dir, root / "chat", 4, 8, True, ["k_proj", "o_proj", "up_proj"], seed=2),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    config = "num_kv_blocks: 128\nnum_threads: 1\nmax_seq_len: 128\n"
    flags = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql']}",
             "--allow-runtime-lora-updating", "true")  # fmt: skip
    with overlap_serve(tiny_model_dir, "engine.yaml", config, *flags) as s:
        yield s


def _models(server) -> dict[str, dict]:
    status, _, body = http("GET", f"{server['url']}/v1/models")
    assert status == 200
    return {m["id"]: m for m in body["data"]}


def test_adapters_are_listed_with_their_parent_and_loaded_and_unloaded_at_run_time(server, adapters):
    base = server["model"]
    models = _models(server)
    assert set(models) == {base, "sql"}
    assert models["sql"]["parent"] == base and models["sql"]["root"] == str(adapters["sql"])
    load = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    status, _, body = http("POST", f"{server['url']}/v1/load_lora_adapter", load)
    assert status == 200 and "chat" in str(body)
    assert set(_models(server)) == {base, "sql", "chat"}
    status, _, body = http("POST", f"{server['url']}/v1/load_lora_adapter", load)
    assert status == 400 and "already loaded" in body["error"]["message"]
    status, _, body = http("POST", f"{server['url']}/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nope"})
    assert status == 400 and "no adapter_config.json" in body["error"]["message"]
    status, _, _ = http("POST", f"{server['url']}/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and set(_models(server)) == {base, "sql"}
    status, _, body = http("POST", f"{server['url']}/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "no LoRA adapter 'chat'" in body["error"]["message"]
    status, _, body = http("POST", f"{server['url']}/v1/completions", {"model": "chat", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    info = 'vllm:lora_requests_info{max_lora="2"'  # once the sidecar has polled the engine's stats (every 0.5 s)
    wait_until(lambda: info in http("GET", f"{server['url']}/metrics")[2], 10, "vllm:lora_requests_info")


def test_the_model_field_picks_the_adapter(server, tiny_model_dir, adapters):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = {name: tokenizer.decode(peft_greedy(tiny_model_dir, adapters.get(name), [PROMPT], NEW_TOKENS)[0],
                                       skip_special_tokens=True)
                for name in (server["model"], "sql")}  # fmt: skip
    assert expected["sql"] != expected[server["model"]]
    for name in (server["model"], "sql"):
        body = {"model": name, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        status, _, out = http("POST", f"{server['url']}/v1/completions", body)
        assert status == 200, out
        assert out["model"] == name and out["choices"][0]["text"] == expected[name]


async def test_runtime_updating_is_refused_unless_allowed(tmp_path):
    from tests.sidecar.test_app_inprocess import make_client

    client = await make_client(tmp_path)
    try:
        response = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert response.status == 403
        body = await response.json()
        assert body["error"]["code"] == "lora_updating_disabled"
        assert "--allow-runtime-lora-updating" in body["error"]["message"]
    finally:
        await client.close()


def test_runtime_updating_follows_vllms_variable(monkeypatch):
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (what the operator sets on a pod with adapters) is the flag's default."""
    import argparse

    from overlap.sidecar.config import add_flags

    def parsed(*argv: str) -> bool:
        parser = argparse.ArgumentParser()
        add_flags(parser)
        return parser.parse_args(list(argv)).allow_runtime_lora_updating

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert parsed() is False
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert parsed() is True and parsed("--allow-runtime-lora-updating", "false") is False
