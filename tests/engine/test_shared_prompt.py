"""Several sequences of one prompt (`n`, `best_of`): the siblings wait for the first to publish the prompt's blocks,
then share them by reference through the prefix cache; what each generates is what it would generate alone."""

from __future__ import annotations

import random

import pytest

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.types import RequestSpec, SamplingParams
from tests.support.engine import run_to_completion, tokens_of


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_siblings_share_the_computed_prompt_and_sample_as_if_alone(tiny_model_dir, num_buffers, two_torch_threads):
    prompt = [random.Random(11).randrange(3, 8192) for _ in range(70)]  # 4 full blocks of 16, then 6 tokens

    def engine() -> Engine:
        return Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=256, num_kv_blocks=128,
                                   num_buffers=num_buffers, max_num_batched_tokens=32))  # fmt: skip

    shared = engine()
    for i in range(4):
        shared.add_request(RequestSpec(f"s{i}", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=i),
                           share_prompt_with=None if i == 0 else "s0"))  # fmt: skip
    outs = run_to_completion(shared)
    assert outs["s0"][-1].num_cached_tokens == 0
    for i in (1, 2, 3):
        assert outs[f"s{i}"][-1].num_cached_tokens == 64  # every full block of the prompt, by reference
    alone = {}
    for i in range(4):
        solo = engine()
        solo.add_request(RequestSpec("x", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=i)))
        alone[i] = tokens_of(run_to_completion(solo)["x"])
    assert [tokens_of(outs[f"s{i}"]) for i in range(4)] == [alone[i] for i in range(4)]
    assert len({tuple(t) for t in alone.values()}) > 1  # seeds differ, so the sequences do


def test_a_sibling_of_a_finished_or_unknown_request_computes_the_prompt_itself(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=256, num_kv_blocks=128))
    engine.add_request(RequestSpec("a", [1, 2, 3], SamplingParams(max_tokens=2), share_prompt_with="nobody"))
    engine.add_request(
        RequestSpec("b", [1, 2, 4], SamplingParams(max_tokens=2), share_prompt_with="a")
    )  # another prompt
    outs = run_to_completion(engine)
    assert len(tokens_of(outs["a"])) == 2 and len(tokens_of(outs["b"])) == 2
