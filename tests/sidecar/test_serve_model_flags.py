"""`overlap serve` with the flags vLLM users type, on a model folder whose generation_config.json sets sampling
defaults: the flags reach the engine (over --config), the served name and context reach /v1/models, and a request
that leaves temperature out gets the model's default."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.support.sidecar import ADMIN_TOKEN, Proc, free_port, http, overlap_cmd, overlap_serve, wait_until


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    model = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("flags") / "model")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "temperature": 0.0}))
    config = "max_num_seqs: 4\nnum_kv_blocks: 256\nnum_threads: 1\n"  # the flags below win over it
    flags = ("--dtype", "bfloat16", "--max-num-seqs", "128", "--max-model-len", "256", "--no-enable-prefix-caching",
             "--seed", "7", "--served-model-name", "llama3-style")  # fmt: skip
    with overlap_serve(model, "engine.yaml", config, *flags) as s:
        yield s


def test_vllm_style_flags_reach_the_engine_over_the_config_file(server):
    status, _, body = http("GET", f"{server['admin']}/admin/config",
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})  # fmt: skip
    assert status == 200
    config = body["config"]
    assert config["dtype"] == "bfloat16" and config["max_num_seqs"] == 128 and config["max_seq_len"] == 256
    assert config["enable_prefix_caching"] is False and config["seed"] == 7
    assert config["num_kv_blocks"] == 256  # what the file set and no flag overrode


def test_served_model_name_and_context_in_models(server):
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0)
    (model,) = client.models.list().data
    assert model.id == "llama3-style" and model.max_model_len == 256


def test_a_request_without_temperature_gets_the_models_default(server):
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(**kw) -> str:
        out = client.completions.create(model="llama3-style", prompt="Once upon a time", max_tokens=16,
                                        extra_body={"ignore_eos": True}, **kw)  # fmt: skip
        return out.choices[0].text

    defaulted = {complete() for _ in range(3)}
    assert defaulted == {complete(temperature=0.0)}  # generation_config's temperature 0: greedy
    assert len({complete(temperature=1.0, seed=s) for s in range(4)}) > 1  # an explicit value still wins


def test_bad_engine_flag_fails_before_anything_starts(tmp_path):
    proc = Proc(overlap_cmd("serve", "--block-size", "12", "--port", str(free_port())), tmp_path / "bad.log")
    wait_until(lambda: not proc.alive(), 60, "overlap serve to exit by itself")
    output = proc.output()
    assert proc.stop() == 2  # the CLI's exit status for a caller's mistake
    assert "block_size must be a power of two in 8..128, got 12" in output
    assert "engine pid" not in output  # nothing was started
