"""`overlap bench spec` end to end on the tiny shape (quick, small), and the copying models it quotes with: the
induction circuit written into a tied, grouped-query Qwen2 and an untied Llama of head size 128 makes transformers'
own greedy output quote a repeated prompt, in fp32 and bf16 (what `--model-shape` builds)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest


def test_quick_run_reports_both_workloads_with_and_without_speculation(tiny_model_dir):
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "spec", "--quick", "--batch-sizes", "1,2",
           "--output-len", "16", "--unit-len", "8", "--json"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # progress goes to stderr
    rows = {(r["workload"], r["batch"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(w, b, m) for w in ("quoting", "random") for b in (1, 2) for m in ("off", "ngram")}
    for (workload, batch, mode), row in rows.items():
        assert row["tokens"] == 16 * batch and row["tpot_ms"] > 0
        off = rows[workload, batch, "off"]
        assert row["vs_off"] == pytest.approx(off["tpot_ms"] / row["tpot_ms"])
        if mode == "off":
            assert row["drafts"] == 0 and row["acceptance"] is None and row["steps"] == 16
    for batch in (1, 2):
        quoting = rows["quoting", batch, "ngram"]
        assert quoting["acceptance"] > 0.9 and quoting["tokens_per_verify_step"] > 3
        assert quoting["steps"] < 8 and len(quoting["acceptance_per_position"]) == 4
        assert 1 >= quoting["acceptance_per_position"][0] >= quoting["acceptance_per_position"][3] > 0.5
        assert rows["random", batch, "ngram"]["steps"] > quoting["steps"]  # the random model seldom repeats


def test_a_draft_model_run_drafts_with_the_tiny_model_for_itself(tiny_model_dir):
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "spec", "--quick", "--method", "draft_model", "--workloads",
           "quoting", "--batch-sizes", "1", "--output-len", "16", "--unit-len", "8", "--json"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    config = report["workloads"]["quoting"]
    assert config["speculative_config"] == {"method": "draft_model", "num_speculative_tokens": 4,
                                            "model": config["model"]}  # fmt: skip
    draft = next(r for r in report["rows"] if r["mode"] == "draft_model")
    assert draft["tokens"] == 16 and draft["acceptance"] == 1.0 and draft["steps"] < 8  # it proposes what it says


@pytest.mark.parametrize("family", ["qwen2-tied-gqa", "llama-head-128"])
def test_copying_weights_make_any_llama_family_shape_quote(family):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from overlap.bench.copy_model import ROPE_THETA, set_copy_weights

    common = dict(vocab_size=1000, intermediate_size=256, num_hidden_layers=3, max_position_embeddings=512,
                  rope_theta=ROPE_THETA)  # fmt: skip
    if family == "qwen2-tied-gqa":
        config = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             **common)  # fmt: skip
    else:
        config = LlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128, **common)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        set_copy_weights(model, config)
    rng = random.Random(0)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        for length in (3, 11):
            unit = [rng.randrange(3, 1000) for _ in range(length)]
            prompt = unit * 3 + unit[:2]
            out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
            assert out[0, len(prompt) :].tolist() == (unit * 10)[2:22], (dtype, length)
