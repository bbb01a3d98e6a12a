"""`overlap serve` of a Gemma 3 folder (sliding and full layers) over real HTTP: the engine logs its split KV pool,
and a prompt past the window, in chunks, comes back as transformers' greedy text, again from the prefix cache."""

from __future__ import annotations

import random
import shutil

import pytest

from tests.support.hf_models import VOCAB, save_variant, transformers_greedy
from tests.support.sidecar import http, metric_value, overlap_serve


def test_gemma3_served_over_http_past_its_window_equals_transformers(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    folder = save_variant("gemma3", tmp_path / "gemma3")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the tiny model's byte-level tokenizer
        shutil.copy(tiny_model_dir / name, folder / name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [random.Random(11).randrange(3, VOCAB) for _ in range(100)]  # window 32
    want = transformers_greedy(hf, prompt, 12)
    with torch.inference_mode():  # the log-probability of each of transformers' tokens where it picked it
        logits = hf(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1]
        want_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(want)[:, None])[:, 0].tolist()
    # random byte tokens are rarely whole UTF-8 text: their log-probabilities say which tokens were picked
    config = "num_threads: 1\nmax_num_seqs: 2\nmax_num_batched_tokens: 32\nnum_kv_blocks: 32\n"
    with overlap_serve(folder, "engine.yaml", config, "--dtype", "float32", "--max-model-len", "256") as server:
        body = {"model": server["model"], "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}  # fmt: skip
        for _ in range(2):  # the second from the prefix cache
            status, _, reply = http("POST", f"{server['url']}/v1/completions", body, timeout=120)
            assert status == 200, reply
            got = reply["choices"][0]["logprobs"]["token_logprobs"]
            assert got == pytest.approx(want_logprobs, abs=1e-3)
        cached = http("GET", f"{server['url']}/metrics")[2]
        log = server["proc"].log_path.read_text()
    assert "for 1 full layers and 10 for 1 sliding layers (window 32)" in log
    assert metric_value(cached, "overlap_prompt_cached_tokens_total") >= 64  # the second request's hit
