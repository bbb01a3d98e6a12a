"""Log-probabilities from the engine: log_softmax of the raw logits, equal to transformers' on the tiny model, only
for requests that ask, and through the overlapped pipeline (two buffers, placeholders) unchanged."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.errors import InvalidRequestError
from overlap.engine.types import SamplingParams
from tests.support.engine import add_and_run, tokens_of


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each generated position: [len(tokens), vocab]."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_logprobs_equal_transformers_log_softmax(tiny_model_dir, hf, num_buffers, two_torch_threads):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=256, num_kv_blocks=128,
                                 num_buffers=num_buffers))  # fmt: skip
    rng = random.Random(4)
    prompts = {f"r{i}": [rng.randrange(3, 8192) for _ in range(rng.randint(3, 30))] for i in range(6)}
    sampling = {
        "r0": SamplingParams(max_tokens=10, temperature=0, logprobs=5),
        "r1": SamplingParams(max_tokens=10, temperature=0.8, seed=1, logprobs=0),  # the sampled token's only
        "r2": SamplingParams(max_tokens=10, temperature=0, logprobs=20),
        "r3": SamplingParams(max_tokens=10, temperature=1.0, top_k=5, seed=2, logprobs=3),
    }
    plain = SamplingParams(max_tokens=10, temperature=0)
    outputs = add_and_run(engine, {rid: (p, sampling.get(rid, plain)) for rid, p in prompts.items()})
    for rid, outs in outputs.items():
        logprobs = [lp for out in outs for lp in (out.logprobs or [])]
        if rid not in sampling:
            assert all(out.logprobs is None for out in outs), rid  # only requests that ask pay for it
            continue
        tokens = tokens_of(outs)
        ref = _reference(hf, prompts[rid], tokens)
        assert len(logprobs) == len(tokens) == 10
        k = sampling[rid].logprobs
        for n, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            assert lp.logprob == pytest.approx(float(ref[n, token]), abs=1e-4), (rid, n)
            top_values, top_ids = ref[n].topk(k) if k else (ref[n][:0], ref[n][:0].long())
            assert [t for t, _ in lp.top] == top_ids.tolist(), (rid, n)
            assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_logprobs_bounds_are_checked():
    with pytest.raises(InvalidRequestError, match=r"logprobs must be an integer in 0\.\.20"):
        SamplingParams(logprobs=21)
    with pytest.raises(InvalidRequestError, match=r"logprobs must be an integer in 0\.\.20"):
        SamplingParams(logprobs=-1)


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_prompt_logprobs_equal_transformers_over_chunks_and_skip_the_prefix_cache(
    tiny_model_dir, hf, num_buffers, two_torch_threads
):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=256, num_kv_blocks=128,
                                 num_buffers=num_buffers, max_num_batched_tokens=16))  # fmt: skip
    prompt = [random.Random(9).randrange(3, 8192) for _ in range(40)]  # three chunks of at most 16 tokens
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # row p predicts token p + 1
    sampling = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=4)
    for rid in ("first", "again"):  # the second would hit the prefix cache; scoring computes it all again
        outs = add_and_run(engine, {rid: (prompt, sampling)})[rid]
        scored = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(scored) == 1 and outs[0].prompt_logprobs is not None  # all of it, with the first output
        lps = scored[0]
        assert len(lps) == len(prompt) and lps[0] is None
        for p in range(1, len(prompt)):
            assert lps[p].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4), p
            values, ids = ref[p - 1].topk(4)
            assert [t for t, _ in lps[p].top] == ids.tolist(), p
            assert [v for _, v in lps[p].top] == pytest.approx(values.tolist(), abs=1e-4)
        assert outs[-1].num_cached_tokens == 0
        assert tokens_of(outs) == ref[-1:].argmax(-1).tolist() + tokens_of(outs)[1:]  # sampling unaffected
