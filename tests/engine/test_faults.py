"""Faults inside a step: the requests it hit fail with a reason, the engine keeps serving the rest, every KV block
comes back and the counts say so (the engine rows of docs/reliability.md)."""

from __future__ import annotations

import random

import pytest
import torch

from overlap.engine import Engine, EngineConfig, SamplingParams
from overlap.engine.batching.scheduler import NONFINITE_ERROR
from overlap.engine.types import FinishReason, RequestSpec
from tests.support.engine import create_engine, reference_tokens, run_to_completion, tokens_of

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.reliability
@pytest.mark.parametrize(
    "fault",
    [RuntimeError("injected step failure"), torch.OutOfMemoryError("simulated: out of memory allocating 2.00 GiB")],
    ids=["exception", "out-of-memory"],
)
def test_a_failed_overlapped_step_fails_its_requests_and_the_step_behind_it_still_runs(fault, reliability) -> None:
    engine = create_engine(num_blocks=64, block_size=4, max_model_len=64, num_buffers=2)
    engine.runner.fail_calls[1] = fault  # the first decode of "hit"
    engine.add_request(RequestSpec("hit", [5, 6, 7], GREEDY))
    outputs = {}
    for out in engine.step():  # submits the prefill and the decode behind it, returns the prefill's outputs
        outputs.setdefault(out.request_id, []).append(out)
    # "late" starts in the step submitted next, which also carries "hit"'s next decode: it is in flight when the
    # failure comes back, and must run for "late" though "hit" has failed.
    engine.add_request(RequestSpec("late", [8, 9], GREEDY))
    for rid, outs in run_to_completion(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert outputs["hit"][-1].finish_reason is FinishReason.ERROR
    assert type(fault).__name__ in outputs["hit"][-1].error and str(fault) in outputs["hit"][-1].error
    assert outputs["late"][-1].finish_reason is FinishReason.LENGTH
    assert tokens_of(outputs["late"]) == reference_tokens([8, 9], GREEDY)
    engine.add_request(RequestSpec("after", [10, 11], GREEDY))  # and the engine goes on serving
    outputs.update(run_to_completion(engine))
    assert tokens_of(outputs["after"]) == reference_tokens([10, 11], GREEDY)
    stats = engine.stats()
    assert stats["requests_finished_total"]["error"] == 1 and stats["num_free_kv_blocks"] == 64
    reliability.row(
        "Engine", f"{'a simulated out-of-memory' if 'memory' in str(fault) else 'an exception'} in an overlapped step",
        load="3 greedy requests, 2 steps in flight", outcome="the step's request failed with the error; the step "
        "in flight behind it and later requests ran, tokens equal to the reference; every KV block back",
        accepted=3, answered=_answered(outputs),
    )  # fmt: skip


@pytest.mark.reliability
@pytest.mark.usefixtures("two_torch_threads")
@pytest.mark.parametrize("num_buffers", [1, 2])
def test_a_nan_in_one_rows_logits_fails_that_request_only(tiny_model_dir, hf_greedy, num_buffers, reliability):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=256, num_kv_blocks=128,
                                 num_buffers=num_buffers))  # fmt: skip
    runner, forward = engine.runner, engine.runner.forward
    sampled: dict[str, int] = {}

    def forward_with_a_nan(inputs):
        logits = forward(inputs)
        for row, rid in enumerate(inputs.request_ids):
            sampled[rid] = sampled.get(rid, 0) + 1
            if rid == "victim" and sampled[rid] == 3:  # its third token: the model "diverges" for this row only
                logits[row, 100] = float("nan")
        return logits

    runner.forward = forward_with_a_nan
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(3, 8192) for _ in range(rng.randint(4, 40))] for i in range(7)}
    prompts["victim"] = [rng.randrange(3, 8192) for _ in range(16)]
    for rid, prompt in prompts.items():
        engine.add_request(RequestSpec(rid, prompt, SamplingParams(max_tokens=10, temperature=0)))
    outputs = run_to_completion(engine)
    victim = outputs["victim"]
    assert victim[-1].finish_reason is FinishReason.ERROR and victim[-1].error == NONFINITE_ERROR
    assert tokens_of(victim) == hf_greedy(prompts["victim"], 2)  # the two tokens before the NaN, nothing after
    for rid, prompt in prompts.items():
        if rid != "victim":
            assert tokens_of(outputs[rid]) == hf_greedy(prompt, 10), rid
    stats = engine.stats()
    assert stats["requests_finished_total"]["error"] == 1 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    reliability.row(
        "Engine", f"a NaN in one sequence's logits ({num_buffers} step{'s' * (num_buffers > 1)} in flight)",
        load="8 greedy requests on the tiny model", outcome="that request failed with the reason after its 2 good "
        "tokens; the 7 others equal transformers' generate; every KV block back",
        accepted=len(prompts), answered=_answered(outputs),
    )  # fmt: skip


def _answered(outputs: dict[str, list]) -> int:
    """Requests whose last output is final: their tokens, or an error with its reason."""
    return sum(1 for outs in outputs.values() if outs and outs[-1].finish_reason is not None)
