"""Logits controls through the engine on the tiny model, against transformers' own logits processors (repetition
penalty, sequence bias, min_new_tokens, bad words) or, for the OpenAI penalties transformers lacks, a reference loop
over transformers' logits. Greedy, so any difference in the controls changes the tokens."""

from __future__ import annotations

import random

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.errors import InvalidRequestError
from overlap.engine.types import FinishReason, SamplingParams
from tests.support.engine import add_and_run, tokens_of

N = 16


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=[1, 2], ids=["1-buffer", "2-buffers"])
def engine(tiny_model_dir, two_torch_threads, request):
    return Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=256, num_kv_blocks=128,
                               num_buffers=request.param))  # fmt: skip


def _prompt(seed: int, length: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(length or rng.randint(8, 24))]


def _hf_generate(hf, prompt: list[int], **kwargs) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, pad_token_id=0, **{"max_new_tokens": N, **kwargs})  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _run(engine, prompt, **sampling) -> list:
    params = SamplingParams(**{"max_tokens": N, "temperature": 0, "ignore_eos": True, **sampling})
    return add_and_run(engine, {"r": (prompt, params)})["r"]


def _bias_to_top(hf, prompt: list[int], token: int, margin: float) -> float:
    """The bias that puts `token` `margin` above the top logit at the first generated position. The tiny model's
    random weights never repeat a token in greedy decoding, so the tests make a token win with a bias and then
    check that the penalty takes it back, exactly as the reference does."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    return float(logits.max() - logits[token]) + margin


def test_repetition_penalty_equals_transformers_also_on_a_prefix_cache_hit(engine, hf):
    prompt = _prompt(1, length=40)  # two full blocks to reuse
    bias = ((prompt[0], _bias_to_top(hf, prompt, prompt[0], 0.5)),)  # a prompt token, just on top
    seq_bias = {(t,): b for t, b in bias}
    want = _hf_generate(hf, prompt, repetition_penalty=1.8, sequence_bias=seq_bias, min_new_tokens=N)
    assert want[0] != prompt[0] == _hf_generate(hf, prompt, sequence_bias=seq_bias, min_new_tokens=N)[0]
    assert tokens_of(_run(engine, prompt, repetition_penalty=1.8, logit_bias=bias)) == want
    again = _run(engine, prompt, repetition_penalty=1.8, logit_bias=bias)  # the prompt now comes from the cache
    assert again[-1].num_cached_tokens > 0 and tokens_of(again) == want


def test_logit_bias_equals_transformers_sequence_bias(engine, hf):
    prompt = _prompt(2)
    free = _hf_generate(hf, prompt, min_new_tokens=N)
    bias = {free[0]: -100.0, 4242: 8.0}
    want = _hf_generate(hf, prompt, min_new_tokens=N, sequence_bias={(t,): b for t, b in bias.items()})
    assert want != free
    assert tokens_of(_run(engine, prompt, logit_bias=tuple(bias.items()))) == want


def test_min_tokens_holds_eos_back_then_eos_stops(engine, hf):
    prompt = _prompt(3)
    eos = 2
    want = _hf_generate(hf, prompt, min_new_tokens=5, sequence_bias={(eos,): 100.0}, eos_token_id=eos)
    assert want == [*want[:5], eos]  # EOS as soon as min_tokens allows it
    outs = _run(engine, prompt, logit_bias=((eos, 100.0),), min_tokens=5, ignore_eos=False)
    assert tokens_of(outs) == want and outs[-1].finish_reason == FinishReason.STOP


def test_bad_words_equal_transformers(engine, hf):
    prompt = _prompt(4)
    free = _hf_generate(hf, prompt, min_new_tokens=N)
    bad = [[free[0]], [free[3], free[4]]]  # one single-token word, one two-token word that greedy would complete
    want = _hf_generate(hf, prompt, min_new_tokens=N, bad_words_ids=bad)
    assert want != free
    assert tokens_of(_run(engine, prompt, bad_words_ids=tuple(tuple(w) for w in bad))) == want


def _reference_penalized(hf, prompt: list[int], bias: dict[int, float], presence: float, frequency: float):
    """OpenAI's formula over transformers' logits: logit + bias - frequency * count - presence * (count > 0)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(N):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            for token, value in bias.items():
                logits[token] += value
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.2), (0.8, 0.6)])
def test_presence_and_frequency_penalties_equal_the_openai_formula(engine, hf, presence, frequency):
    prompt = _prompt(5)
    favourite = 4242
    bias = {favourite: _bias_to_top(hf, prompt, favourite, 3.0)}  # a token greedy then repeats
    assert _reference_penalized(hf, prompt, bias, 0.0, 0.0).count(favourite) >= 3
    want = _reference_penalized(hf, prompt, bias, presence, frequency)
    assert want != _reference_penalized(hf, prompt, bias, 0.0, 0.0)
    got = _run(engine, prompt, logit_bias=tuple(bias.items()), presence_penalty=presence, frequency_penalty=frequency)
    assert tokens_of(got) == want


def test_plain_requests_in_the_same_batch_are_untouched(engine, hf):
    prompts = {f"p{i}": _prompt(10 + i) for i in range(4)}
    sampling = {rid: SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **(
        {"frequency_penalty": 2.0, "logit_bias": ((7, 50.0),)} if rid == "p0" else {})) for rid in prompts}  # fmt: skip
    outs = add_and_run(engine, {rid: (p, sampling[rid]) for rid, p in prompts.items()})
    for rid in ("p1", "p2", "p3"):
        assert tokens_of(outs[rid]) == _hf_generate(hf, prompts[rid], min_new_tokens=N), rid


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 10\]"),
        ({"logit_bias": ((5, 101.0),)}, r"logit_bias values must be in \[-100, 100\]"),
        ({"min_tokens": 20}, r"min_tokens must be in 0\.\.max_tokens \(16\)"),
        ({"bad_words_ids": ((),)}, r"bad_words must not be empty"),
    ],
)
def test_bad_control_values_are_refused(changes, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(max_tokens=16, **changes)


def test_extreme_but_valid_values_sample_without_breaking_the_row(engine, hf):
    """Found by the API fuzzing: a repetition penalty of 5e-324 divided a positive logit to +inf and the request
    failed as if the model had diverged; a temperature of 1e-300 is 0 in fp32 and divided the logits by zero."""
    prompt = _prompt(5)
    greedy = tokens_of(_run(engine, prompt))
    assert tokens_of(_run(engine, prompt, temperature=1e-300, seed=1)) == greedy
    rewarded = _run(engine, prompt, repetition_penalty=5e-324)
    assert rewarded[-1].finish_reason == FinishReason.LENGTH and len(tokens_of(rewarded)) == N
    assert set(tokens_of(rewarded)) <= set(prompt) | set(greedy)  # seen tokens win, now by a finite margin
