"""Tensor parallelism on CPU (gloo): a model split across 2 (and 4) rank processes computes what one process does.

Per family of the conformance matrix (tests/support/hf_models.py): greedy tokens equal to size 1 for 16 prompts x
64 tokens and fp32 logits within 1e-4; a decode step runs exactly 2 all-reduces per layer, the embedding's
all-reduce and the LM head's gather; each rank holds its share of the weights and of the KV pool. Through `overlap
serve`: a rank killed mid-generation fails every request in flight within 10 s, the engine exits non-zero, and the
engine `overlap serve` restarts serves again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ModelLoadError
from overlap.engine.model.experts import MoeSpec
from overlap.engine.model.model_spec import read_spec
from overlap.engine.model.parallel import plan_shard
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq
from tests.support.hf_models import VOCAB, save_variant
from tests.support.ranks import rank_pids, stream_completions
from tests.support.sidecar import http, overlap_serve, wait_until

GREEDY = SamplingParams(temperature=0, max_tokens=64)
# Every family and what tells it apart: tied embeddings, biases (row-parallel ones added once), a sliding window,
# q/k norms, fused q|k|v and gate|up checkpoints, partial rotary; mixtures of experts (every rank holds every expert,
# a share of each one's width; a shared expert and a dense layer; Mixtral's fp32 routing weights); Gemma 3's scaled
# embeddings over the vocabulary slices, soft-capped logits after the gather, sandwich norms after the all-reduces, a
# RoPE per layer type; gpt-oss's attention sinks sharded with their heads, its fused experts (gate and up
# interleaved) sharded along their width, their down biases added once.
FAMILIES = ("llama", "llama-biases-head-dim", "mistral-sliding-window", "qwen2", "qwen3", "phi3",
            "phi3-partial-rotary", "qwen3-moe", "qwen2-moe", "mixtral", "gemma3", "gpt-oss")  # fmt: skip


def _runner(folder: Path, size: int) -> ModelRunner:
    config = EngineConfig(num_kv_blocks=160, max_seq_len=512, num_threads=1, tensor_parallel_size=size)
    return ModelRunner(config, folder)


def _generate(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of every prompt (prefill in one step, then decode together), and the collectives each decode
    step ran (size > 1)."""
    block = runner.block_size
    tables, at = [], 0
    for prompt in prompts:
        need = -(-(len(prompt) + new_tokens) // block)
        tables.append(list(range(at, at + need)))
        at += need
    seqs = [ScheduledSeq(f"r{i}", p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
    outputs = [[t] for t in runner.execute(ModelInput(seqs)).token_ids]
    per_step = []
    for step in range(1, new_tokens):
        before = runner.tp.count if runner.tp else 0
        seqs = [ScheduledSeq(f"r{i}", [out[-1]], len(p) + step - 1, tables[i], True, GREEDY, step)
                for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))]  # fmt: skip
        for out, token in zip(outputs, runner.execute(ModelInput(seqs)).token_ids, strict=True):
            out.append(token)
        per_step.append((runner.tp.count if runner.tp else 0) - before)
    return outputs, per_step


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_compute_what_one_does(family, tmp_path):
    folder = save_variant(family, tmp_path / family)
    prompts = _prompts(16)
    one, two = _runner(folder, 1), _runner(folder, 2)
    try:
        batch = ModelInput([ScheduledSeq("a", prompts[0], 0, [0, 1, 2], True, GREEDY),
                            ScheduledSeq("b", prompts[1], 0, [3, 4, 5], True, GREEDY)])  # fmt: skip
        torch.testing.assert_close(two.compute_logits(batch), one.compute_logits(batch), atol=1e-4, rtol=0)
        expected, _ = _generate(one, prompts, 64)
        got, collectives = _generate(two, prompts, 64)
        assert got == expected
        layers = read_spec(folder).num_layers
        assert set(collectives) == {2 * layers + 2}  # o and down (or experts) per layer, the embedding, LM head
    finally:
        two.close()
        one.close()


def test_four_ranks_share_the_kv_heads_there_are_fewer_of(tmp_path):
    """2 KV heads over 4 ranks: each KV head is held by two ranks, each with its own query heads."""
    folder = save_variant("llama", tmp_path / "llama")
    assert plan_shard(read_spec(folder), 3, 4).kv_heads == (1, 2)
    prompts = _prompts(4, seed=1)
    one, four = _runner(folder, 1), _runner(folder, 4)
    try:
        assert _generate(four, prompts, 16)[0] == _generate(one, prompts, 16)[0]
    finally:
        four.close()
        one.close()


def test_each_rank_holds_its_share_of_the_weights_and_the_kv_pool(tiny_model_dir):
    one, two = _runner(tiny_model_dir, 1), _runner(tiny_model_dir, 2)
    try:
        weights = two.weight_bytes / one.weight_bytes
        kv = two.k_pool.nbytes / one.k_pool.nbytes
        print(
            f"rank 0 of 2: weights {two.weight_bytes / 1e6:.1f} of {one.weight_bytes / 1e6:.1f} MB ({weights:.3f}), "
            f"KV pool {two.k_pool.nbytes * 2 / 1e6:.1f} of {one.k_pool.nbytes * 2 / 1e6:.1f} MB ({kv:.3f})"
        )
        assert abs(weights - 0.5) <= 0.05 and abs(kv - 0.5) <= 0.05
    finally:
        two.close()
        one.close()


def test_a_size_the_heads_do_not_divide_is_refused_with_the_reason(tiny_model_dir):
    spec = read_spec(tiny_model_dir)  # 8 heads, 8 KV heads
    with pytest.raises(ModelLoadError, match="does not divide the MLP's intermediate size 1370"):
        plan_shard(dataclasses.replace(spec, intermediate_size=1370), 0, 4)
    odd = dataclasses.replace(spec, num_heads=12, num_kv_heads=6)
    with pytest.raises(ModelLoadError, match="neither divides the 6 KV heads"):
        plan_shard(odd, 0, 4)
    with pytest.raises(ModelLoadError, match="does not divide the 12 attention heads"):
        plan_shard(odd, 0, 8)
    experts = MoeSpec(8, 2, 30, norm_topk_prob=True, weights_fp32=False, shared_intermediate_size=64,
                      sparse=(True,), prefix="mlp")  # fmt: skip
    with pytest.raises(ModelLoadError, match="does not divide each expert's intermediate size 30"):
        plan_shard(dataclasses.replace(spec, moe=experts), 0, 4)
    # every layer sparse: the dense width is never run, so it need not divide (Qwen-MoE configs carry one)
    sparse = dataclasses.replace(experts, intermediate_size=32)
    assert plan_shard(dataclasses.replace(spec, intermediate_size=1370, moe=sparse), 0, 4).rank == 0
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 2, 4 or 8"):
        EngineConfig(tensor_parallel_size=3)


def test_the_engine_on_two_ranks_serves_prefix_hits_chunks_logprobs_and_a_retune_as_on_one(tmp_path):
    """Through the Engine: chunked prefill, a prefix-cache hit, two steps in flight, logprobs and a live retune of
    the batch limit, all on rank 0's side of the batch, give what one rank gives."""
    from overlap.engine.core import Engine
    from tests.support.engine import add_and_run, tokens_of

    folder = save_variant("qwen2", tmp_path / "qwen2")
    prompt = _prompts(1, seed=5)[0] * 3
    sampling = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)

    def run(size: int) -> tuple[list, list, list]:
        engine = Engine(EngineConfig(model=str(folder), max_seq_len=512, num_kv_blocks=96, max_num_batched_tokens=32,
                                     num_buffers=2, num_threads=1, tensor_parallel_size=size))  # fmt: skip
        try:
            first = add_and_run(engine, {"a": (prompt, sampling)})["a"]
            engine.reconfigure(engine.config.live.replace(max_num_seqs=2))
            again = add_and_run(engine, {"b": (prompt, sampling), "c": (prompt[:20], sampling)})
            assert again["b"][-1].num_cached_tokens >= 16  # served from the prefix cache
            logprobs = [lp for out in first for lp in (out.logprobs or [])]
            return tokens_of(first), [tokens_of(again["b"]), tokens_of(again["c"])], logprobs
        finally:
            engine.close()
            engine.runner.close()

    one, two = run(1), run(2)
    assert two[0] == one[0] and two[1] == one[1]
    for a, b in zip(one[2], two[2], strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_rank_that_stops_answering_fails_the_step_after_the_collective_timeout(tiny_model_dir, monkeypatch):
    """A rank frozen (SIGSTOP) mid-service: rank 0's next step waits in the collective for the timeout, then fails
    with RankLost instead of hanging."""
    from overlap.engine.errors import RankLost
    from overlap.engine.model import parallel

    monkeypatch.setattr(parallel, "COLLECTIVE_TIMEOUT_S", 2.0)  # rank 0's side of the wait
    two = _runner(tiny_model_dir, 2)
    (rank,) = rank_pids(os.getpid())
    try:
        batch = ModelInput([ScheduledSeq("a", [1, 40, 50], 0, [0], True, GREEDY)])
        two.execute(batch)
        os.kill(rank, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RankLost, match="tensor-parallel step failed"):
            two.execute(ModelInput([ScheduledSeq("b", [1, 41, 51], 0, [1], True, GREEDY)]))
        assert time.monotonic() - started < 2.0 + 5
    finally:
        os.kill(rank, signal.SIGKILL)
        two.close()


# ---- through `overlap serve` -----------------------------------------------------------------------------------
def test_a_rank_killed_mid_generation_fails_its_requests_and_the_restarted_engine_serves(tiny_model_dir):
    with overlap_serve(tiny_model_dir, "engine.yaml", "max_num_seqs: 8\n", "--tensor-parallel-size", "2") as served:
        wait_until(lambda: rank_pids(served["proc"].pid), 60, "the second rank's process")
        (rank,) = rank_pids(served["proc"].pid)

        async def kill_during_load() -> tuple[list[str], float]:
            load = asyncio.ensure_future(stream_completions(served["url"], served["model"], 6))
            await asyncio.sleep(1.5)  # every request streaming
            os.kill(rank, signal.SIGKILL)
            killed = time.monotonic()
            results = await load
            return results, time.monotonic() - killed

        results, answered_s = asyncio.run(kill_during_load())
        assert all(r != "finished" for r in results) and all(r != "cut" for r in results), results
        assert answered_s < 10, f"the requests in flight took {answered_s:.1f} s to be answered"
        log = served["proc"].output()
        wait_until(lambda: "the engine exited with status 70" in served["proc"].output(), 30, "the engine's exit")
        assert "RankLost" in log or "cannot go on" in served["proc"].output()
        wait_until(lambda: http("POST", f"{served['url']}/v1/completions",
                                {"model": served["model"], "prompt": "again", "max_tokens": 4}, timeout=30)[0] == 200,
                   120, "the restarted engine to serve")  # fmt: skip
        assert len(rank_pids(served["proc"].pid)) == 1  # the restarted engine has its second rank again
