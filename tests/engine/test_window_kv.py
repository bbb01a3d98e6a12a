"""The sliding layers' own KV pool in a model that mixes sliding and full layers (batching/window_blocks.py): blocks
behind the window go back, prefix hits stay correct, and the pool holds more tokens in the same bytes."""

from __future__ import annotations

import random

import pytest

from overlap.engine.batching.block_manager import BlockManager
from overlap.engine.batching.window_blocks import NULL_BLOCK, WindowBlocks
from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.types import RequestSpec, SamplingParams
from tests.support.engine import add_and_run, create_requests, tokens_of
from tests.support.hf_models import VOCAB, transformers_greedy

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _managers(num_window_blocks: int = 16) -> BlockManager:
    """bs 4, window 8: a query at p reads blocks (p - 7) // 4 on, so at most 3 blocks plus its chunk's."""
    return BlockManager(32, 4, True, WindowBlocks(num_window_blocks, 4, 8))


def test_sliding_blocks_behind_the_window_go_back_and_free_returns_the_rest() -> None:
    bm = _managers()
    window = bm.window
    (r,) = create_requests(1, prompt_len=30, max_tokens=4)
    assert bm.allocate(r, 12) == 0  # the first chunk: the full layers reserve the prompt, the sliding ones 12 tokens
    assert len(r.block_ids) == 8 and r.window_block_ids == [1, 2, 3]
    r.num_computed_tokens = 12
    bm.register_computed_blocks(r, 12)  # the next query (12) reads keys 5 .., so block 0 (positions 0-3) goes back
    assert r.window_block_ids == [NULL_BLOCK, 2, 3] and window.num_free_blocks == 14
    bm.check_invariants([r])
    window.check_invariants([r])
    assert bm.append_slots(r, 18)  # the rest of the prompt
    r.num_computed_tokens = 30
    bm.register_computed_blocks(r, 30)  # keys 23 .. : blocks 5, 6, 7 (positions 20 .. 31) stay
    assert r.window_block_ids[:5] == [NULL_BLOCK] * 5 and len(r.window_block_ids) == 8
    assert window.num_free_blocks == 16 - 3
    for _ in range(4):  # decodes: one block in, one out, never more than 3 (+1 while one is being filled)
        assert bm.append_slots(r, 1)
        r.num_computed_tokens += 1
        bm.register_computed_blocks(r, r.num_computed_tokens)
        assert sum(b != NULL_BLOCK for b in r.window_block_ids) <= 3
        window.check_invariants([r])
    assert len(r.window_block_ids) == 9 and bm.append_slots(r, 5)  # a speculative step's proposals: a 10th block
    assert len(r.window_block_ids) == 10
    bm.trim(r, r.num_computed_tokens)  # all rejected: the block that held only proposals goes back
    assert len(r.window_block_ids) == 9
    window.check_invariants([r])
    bm.free(r)
    assert window.num_free_blocks == 16 and bm.num_free_blocks == 32 and r.window_block_ids == []
    window.check_invariants([])


def test_a_prefix_hit_needs_the_sliding_blocks_in_its_window() -> None:
    bm = _managers()
    a, b, c = create_requests(3, prompt_len=30, same_prompt=True)
    assert bm.allocate(a) == 0
    a.num_computed_tokens = 30
    bm.register_computed_blocks(a, 30)  # full layers: blocks 0-6 cached; sliding: 5, 6 held, 0-4 back, still cached
    assert bm.allocate(b) == 28  # 7 full blocks; the window of position 28 (keys 21 ..) is blocks 5 and 6
    assert b.window_block_ids[:5] == [NULL_BLOCK] * 5 and b.window_block_ids[5:7] == a.window_block_ids[5:7]
    bm.check_invariants([a, b])
    bm.window.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    for _ in range(16):  # take every sliding block, evicting the cached ones
        (filler,) = create_requests(1, prompt_len=4)
        bm.window.allocate(filler, [], 0, 4)
    bm.window.free(filler)  # one free block again, its cached key gone
    assert bm.allocate(c, 4) == 0  # the full layers still hold the prefix, the sliding ones no longer: no hit


def _engine(folder, **config) -> Engine:
    return Engine(EngineConfig(model=str(folder), max_seq_len=256, block_size=16, **config))


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss"])
def test_tokens_equal_transformers_when_the_window_pool_must_reuse_blocks(built, name):
    """Window 32, chunks of 32, prompts of 100 and 200 tokens: the sliding layers' pool (10 blocks for 2 sequences)
    holds fewer blocks than the longer one's context alone (14), so it serves it only by reusing those behind the
    window; then the same prompt again is a prefix hit that needs the sliding blocks still cached."""
    folder, hf = built(name)
    engine = _engine(folder, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=48)
    assert engine.block_manager.window.num_blocks == 2 * 4 + 2  # 2 sequences x (window + a block) + a step's
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (100, 200)]
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = add_and_run(engine, {f"r{i}": (p, sampling) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        assert tokens_of(out[f"r{i}"]) == transformers_greedy(hf, prompt, 24)
    again = add_and_run(engine, {"hit": (prompts[1], sampling)})["hit"]
    assert again[-1].num_cached_tokens >= 64 and tokens_of(again) == transformers_greedy(hf, prompts[1], 24)
    stats = engine.stats()
    assert stats["num_free_window_kv_blocks"] == stats["num_window_kv_blocks"] == 10


def test_a_mixed_model_pool_holds_more_tokens_in_the_same_bytes(built):
    """gemma3 (a sliding layer, then a full one), 16 blocks of every layer's bytes: the sliding layer needs 10, so the
    full one gets 22, and two requests of 11 blocks each run side by side, where one pool for every layer (16 blocks)
    would hold only one of them at a time."""
    folder, _ = built("gemma3")
    engine = _engine(folder, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=16)
    runner = engine.runner
    assert (runner.kv_split.num_full_blocks, runner.kv_split.num_window_blocks) == (22, 10)
    one_block = runner.k_pool[0, :16].numel()
    assert runner.k_pool.numel() + runner.window_k_pool.numel() == (16 * 2 + 1) * one_block  # same bytes + null block
    assert "352 tokens, 1.38x one pool for every layer" in runner.kv_split.describe(16)
    rng = random.Random(8)
    sampling = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(2):  # 150 + 20 tokens: 11 blocks each
        engine.add_request(RequestSpec(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(150)], sampling))
    most_running = 0
    while engine.has_unfinished():
        engine.step()
        most_running = max(most_running, engine.stats()["num_running"])
    assert most_running == 2 and engine.stats()["num_preemptions_total"] == 0


def test_a_chunk_gets_what_the_sliding_pool_holds_and_the_prompt_completes() -> None:
    """A sliding pool of 5 blocks (bs 4, window 8) and a budget of 16: a chunk never needs more than the pool holds
    now, so the prompt goes through in chunks cut to fit, the blocks behind the window coming back between them."""
    from overlap.engine.batching.scheduler import Scheduler
    from tests.support.engine import EOS, FakeRunner, reference_tokens, run_step

    config = EngineConfig(max_seq_len=512, max_num_batched_tokens=16)
    bm = BlockManager(64, 4, True, WindowBlocks(5, 4, 8))
    scheduler, runner = Scheduler(config, bm, 512, frozenset({EOS})), FakeRunner(64, 4, 512)
    (request,) = create_requests(1, prompt_len=40, max_tokens=4)
    scheduler.add_request(request, 0.0)
    chunks, outputs = [], []
    for step in range(40):
        batch, updated = run_step(scheduler, runner, float(step))
        chunks += [len(s.token_ids) for s in batch.model_input.seqs if len(s.token_ids) > 1]
        outputs += [t for r in updated for t in r.output_token_ids[len(outputs) :]]
        assert sum(b != NULL_BLOCK for b in request.window_block_ids) <= 5
        if not scheduler.num_unfinished:
            break
    assert chunks[0] == 16 and max(chunks[1:]) < 16 and sum(chunks) == 40  # cut to what the pool holds
    assert request.output_token_ids == reference_tokens(request.prompt_token_ids, request.sampling)
    bm.window.check_invariants([])


def test_a_live_retune_stays_within_what_the_sliding_pool_holds(built):
    """The sliding pool is sized for the start-up limits (2 sequences x 4 blocks + a step's 2); a retune to more
    sequences or a larger step is cut to what it holds, so running prefills never wait on it with nothing to
    preempt."""
    folder, _ = built("gemma3")
    engine = _engine(folder, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=48)
    live = engine.config.live
    assert engine.reconfigure(live.replace(max_num_seqs=64)).max_num_seqs == 2
    assert engine.reconfigure(live.replace(max_num_seqs=64, max_num_batched_tokens=16)).max_num_seqs == 2  # (10-1)//4
    assert engine.reconfigure(live.replace(max_num_seqs=2, max_num_batched_tokens=64)).max_num_seqs == 1
