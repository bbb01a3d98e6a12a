"""The engine on the real tiny model: greedy tokens equal transformers' `generate`, however they are batched,
chunked, preempted or served from the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from overlap.engine import Engine, EngineConfig, SamplingParams
from overlap.engine.types import FinishReason, RequestSpec
from tests.support.engine import add_and_run, tokens_of

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _prompts(n: int, seed: int, min_len: int = 1, max_len: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8192) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def _run(engine: Engine, requests: dict[str, tuple[list[int], int]]) -> dict[str, list]:
    """Greedy requests given as (prompt, max_tokens)."""
    return add_and_run(
        engine, {rid: (prompt, SamplingParams(max_tokens=n, temperature=0)) for rid, (prompt, n) in requests.items()}
    )


def _engine(model_dir: Path, **config) -> Engine:
    config.setdefault("max_seq_len", 256)
    config.setdefault("num_kv_blocks", 256)
    return Engine(EngineConfig(model=str(model_dir), **config))


def test_one_request_matches_transformers(tiny_model_dir: Path, hf_greedy) -> None:
    engine = _engine(tiny_model_dir)
    prompt = _prompts(1, seed=1, min_len=20, max_len=20)[0]
    outputs = _run(engine, {"one": (prompt, 24)})
    assert tokens_of(outputs["one"]) == hf_greedy(prompt, 24)
    assert outputs["one"][-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert engine.model_dir == tiny_model_dir and engine.vocab_size == 8192


@pytest.mark.parametrize(
    ("chunked", "budget"),
    [(True, 64), (False, 256)],
    ids=["chunked-prefill", "whole-prefill"],
)
def test_32_mixed_length_requests_batched_match_transformers(
    tiny_model_dir: Path, hf_greedy, chunked: bool, budget: int
) -> None:
    engine = _engine(tiny_model_dir, enable_chunked_prefill=chunked, max_num_batched_tokens=budget, max_num_seqs=32)
    rng = random.Random(7)
    requests = {f"r{i}": (p, rng.randint(4, 16)) for i, p in enumerate(_prompts(32, seed=2))}
    outputs = _run(engine, requests)
    for rid, (prompt, max_tokens) in requests.items():
        assert tokens_of(outputs[rid]) == hf_greedy(prompt, max_tokens), rid
    stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["avg_batch_size"] > 4  # they really ran together
    if chunked:  # some prompts (up to 90 tokens) were split across steps under a 64-token budget
        assert max(len(p) for p, _ in requests.values()) > budget


def test_forced_preemption_and_resume_match_transformers(tiny_model_dir: Path, hf_greedy) -> None:
    # 10 blocks of 16 slots = 160 token slots for 8 requests that need 8 x (40 + 24) = 512 at the end.
    engine = _engine(tiny_model_dir, num_kv_blocks=10, max_seq_len=128, enable_prefix_caching=False)
    requests = {f"p{i}": (p, 24) for i, p in enumerate(_prompts(8, seed=3, min_len=30, max_len=40))}
    outputs = _run(engine, requests)
    assert engine.stats()["num_preemptions_total"] > 0
    preempted = [rid for rid, outs in outputs.items() if outs[-1].times.num_preemptions > 0]
    assert preempted
    for rid, (prompt, max_tokens) in requests.items():
        assert tokens_of(outputs[rid]) == hf_greedy(prompt, max_tokens), rid
    assert engine.stats()["num_free_kv_blocks"] == 10


def test_repeated_prompt_hits_the_prefix_cache_with_identical_outputs(tiny_model_dir: Path, hf_greedy) -> None:
    engine = _engine(tiny_model_dir)
    prompt = _prompts(1, seed=4, min_len=70, max_len=70)[0]
    first = _run(engine, {"first": (prompt, 16)})["first"]
    second = _run(engine, {"second": (prompt, 16)})["second"]
    assert second[-1].num_cached_tokens == 64  # 4 full blocks of 16; the 70th token is recomputed
    assert tokens_of(second) == tokens_of(first) == hf_greedy(prompt, 16)
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] == 64 and stats["prefix_cache_hit_rate"] == 64 / 140


def test_seeded_sampling_is_the_same_alone_batched_and_across_preemption(tiny_model_dir: Path) -> None:
    prompts = _prompts(6, seed=5, min_len=30, max_len=40)
    sampling = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=1234, ignore_eos=True)

    def run(engine: Engine, ids: list[int]) -> dict[str, list[int]]:
        for i in ids:
            engine.add_request(RequestSpec(f"s{i}", prompts[i], sampling))
        outputs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outputs

    alone = run(_engine(tiny_model_dir), [0])["s0"]
    squeezed = _engine(tiny_model_dir, num_kv_blocks=10, max_seq_len=128, enable_prefix_caching=False)
    together = run(squeezed, list(range(6)))
    assert squeezed.stats()["num_preemptions_total"] > 0
    assert together["s0"] == alone
    assert len(set(map(tuple, together.values()))) == 6  # different prompts, different samples


async def test_generate_streams_from_the_real_model(tiny_model_dir: Path, hf_greedy) -> None:
    import asyncio

    engine = _engine(tiny_model_dir)
    prompts = _prompts(3, seed=6, min_len=5, max_len=20)

    async def collect(i: int) -> list[int]:
        sampling = SamplingParams(max_tokens=8, temperature=0)
        return [
            t async for out in engine.generate(RequestSpec(f"g{i}", prompts[i], sampling)) for t in out.new_token_ids
        ]

    try:
        results = await asyncio.wait_for(asyncio.gather(*(collect(i) for i in range(3))), timeout=120)
    finally:
        engine.close()
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == hf_greedy(prompt, 8)


def test_32_mixed_requests_in_bf16_agree_with_transformers_bf16(tiny_model_dir: Path) -> None:
    """bf16 end to end (oneDNN projections, the native kernel, a bf16 KV pool) against transformers in bf16.

    An exact match of whole continuations is not possible: both round to bf16 (8 significant bits) at different
    places (our attention sums in fp32 and rounds once; transformers rounds its matmuls' outputs), so near-tied
    logits can flip, and after one flip the continuations part ways. So the test teacher-forces: transformers scores
    the prompt plus our tokens in one forward, and at every generated position our token must be transformers'
    top-1, or lose to it by less than a bf16 rounding margin; at least 90% must be exact top-1.
    """
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model_dir, dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=32)
    rng = random.Random(11)
    requests = {f"r{i}": (p, rng.randint(4, 12)) for i, p in enumerate(_prompts(32, seed=3))}
    outputs = _run(engine, requests)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    exact, total, worst_gap = 0, 0, 0.0
    for rid, (prompt, _) in requests.items():
        ours = tokens_of(outputs[rid])
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1].float()
        for position, token in enumerate(ours):
            gap = (logits[position].max() - logits[position, token]).item()
            exact += gap == 0
            total += 1
            worst_gap = max(worst_gap, gap)
    # The logits span about +-20: one bf16 rounding of a logit is up to 0.06, and it compounds over 6 layers.
    print(f"bf16 top-1 agreement {exact}/{total}, largest gap {worst_gap:.3f}")  # shown with pytest -s
    assert worst_gap < 0.5, f"a token {worst_gap:.2f} below transformers' top-1"
    assert exact / total >= 0.9, f"top-1 agreement {exact}/{total}"
