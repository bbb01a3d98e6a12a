"""BlockManager: reservation, growth, release, reference counts and prefix caching."""

from __future__ import annotations

from overlap.engine.batching.block_manager import BlockManager
from tests.support.engine import create_requests


def test_allocate_reserves_the_whole_prompt_and_free_returns_it() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    (r,) = create_requests(1, prompt_len=9)
    assert bm.can_allocate(r)
    assert bm.allocate(r) == 0
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 7
    assert r.block_ids == [0, 1, 2]  # a fresh pool hands out a contiguous run
    bm.check_invariants([r])
    bm.free(r)
    assert bm.num_free_blocks == 10 and r.block_ids == []
    bm.check_invariants([])


def test_allocate_returns_none_when_the_pool_is_short() -> None:
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = create_requests(2, prompt_len=9)
    assert bm.allocate(a) == 0
    assert not bm.can_allocate(b)
    assert bm.allocate(b) is None
    assert b.block_ids == [] and bm.num_free_blocks == 1
    bm.check_invariants([a])


def test_append_slots_adds_a_block_only_at_a_boundary_and_prefers_the_next_id() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    (r,) = create_requests(1, prompt_len=4)
    bm.allocate(r)
    r.num_computed_tokens = 4
    assert bm.num_blocks_missing(r, 1) == 1
    assert bm.append_slots(r, 1)
    assert r.block_ids == [0, 1]
    r.num_computed_tokens = 5
    assert bm.append_slots(r, 3) and len(r.block_ids) == 2  # positions 5..7 fit block 1


def test_append_slots_fails_cleanly_when_the_pool_is_empty() -> None:
    bm = BlockManager(num_blocks=1, block_size=4, enable_prefix_caching=False)
    (r,) = create_requests(1, prompt_len=4)
    bm.allocate(r)
    r.num_computed_tokens = 4
    assert not bm.append_slots(r, 1)
    assert r.block_ids == [0]


def test_prefix_cache_shares_full_blocks_and_keeps_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=20, block_size=4)
    a, b = create_requests(2, prompt_len=12, same_prompt=True)
    assert bm.allocate(a) == 0
    bm.register_computed_blocks(a, 12)  # a's prefill ran: all three full blocks are published
    # b has the same 12 tokens; at most 2 blocks can be hits so its last token is computed for the logits.
    assert bm.allocate(b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.ref_counts[a.block_ids[0]] == 2
    bm.check_invariants([a, b])
    assert bm.prefix_cache_queries == 24 and bm.prefix_cache_hits == 8
    assert bm.prefix_cache_hit_rate == 8 / 24


def test_freed_blocks_stay_cached_until_evicted_lru() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    (a,) = create_requests(1, prompt_len=9)
    bm.allocate(a)
    bm.register_computed_blocks(a, 9)  # blocks 0 and 1 full -> cached; block 2 partial
    bm.free(a)
    assert bm.num_free_blocks == 4
    (again,) = create_requests(1, prompt_len=9)
    again.prompt_token_ids[:] = a.prompt_token_ids
    again.all_token_ids[:] = a.all_token_ids
    assert bm.allocate(again) == 8  # a freed prefix is still a hit
    bm.free(again)
    # Now fill the pool with unrelated tokens: the cached blocks are evicted and the hit is gone.
    (other,) = create_requests(1, prompt_len=16)
    other.all_token_ids[:] = [50] * 16
    assert bm.allocate(other) == 0
    bm.free(other)
    (third,) = create_requests(1, prompt_len=9)
    third.all_token_ids[:] = a.all_token_ids
    assert bm.allocate(third) == 0
    bm.check_invariants([third])


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    a, b = create_requests(2, prompt_len=12, same_prompt=True)
    bm.allocate(a)
    bm.register_computed_blocks(a, 12)
    assert bm.allocate(b) == 0
    assert bm.prefix_cache_hit_rate == 0.0


def _is_run(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def test_growth_room_is_claimed_so_decoding_tables_stay_contiguous() -> None:
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    a, b = create_requests(2, prompt_len=8, max_tokens=12)  # 2 blocks now, 5 in the end
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_ids == [0, 1] and b.block_ids == [5, 6]  # b skips a's claimed blocks 2..4
    a.num_computed_tokens = b.num_computed_tokens = 8  # prefill ran
    for _ in range(12):
        for r in (a, b):
            assert bm.append_slots(r, 1)
            r.num_computed_tokens += 1
            r.append_output_token(3)
        bm.check_invariants([a, b])
    assert len(a.block_ids) == 5 and _is_run(a.block_ids) and _is_run(b.block_ids)
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 64


def test_claims_never_cost_capacity() -> None:
    # 6 blocks: a claims 2..5 for its growth, yet b still gets blocks (from the claimed ones) when nothing else is left.
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    (a,) = create_requests(1, prompt_len=8, max_tokens=16)
    (b,) = create_requests(1, prompt_len=16, max_tokens=1)
    bm.allocate(a)
    assert a.claim_end == 6
    assert bm.can_allocate(b) and bm.allocate(b) == 0
    assert sorted(b.block_ids) == [2, 3, 4, 5]
    bm.check_invariants([a, b])
    a.num_computed_tokens = 8
    assert not bm.append_slots(a, 1)  # the pool really is full now
    bm.free(b)
    assert bm.append_slots(a, 1) and len(a.block_ids) == 3
    bm.check_invariants([a])


def test_the_cache_logs_what_it_stores_and_evicts_with_the_hashes_a_router_computes() -> None:
    """Events in order: stored hashes equal `block_hashes` of the request's tokens; reusing a freed block evicts it."""
    from overlap.engine.prefix_hash import REMOVED, STORED, block_hashes

    bm = BlockManager(num_blocks=3, block_size=4)
    (a,) = create_requests(1, prompt_len=12)
    bm.allocate(a)
    bm.register_computed_blocks(a, 12)
    expected = block_hashes(a.prompt_token_ids, 4)
    assert len(expected) == 3 and bm.kv_events.since(0) == [(STORED, h) for h in expected]
    assert sorted(bm.cached_hashes()) == sorted(expected)
    bm.free(a)
    _, b = create_requests(2, prompt_len=5)  # other tokens: takes the least recently freed blocks, evicting them
    bm.allocate(b)
    evicted = bm.kv_events.since(3)
    assert [kind for kind, _ in evicted] == [REMOVED, REMOVED] and {h for _, h in evicted} <= set(expected)
    assert bm.kv_events.since(bm.kv_events.next_seq) == []
    assert len(bm.cached_hashes()) == 1


def test_a_reader_behind_the_event_window_or_from_another_engine_gets_none() -> None:
    from overlap.engine.prefix_hash import STORED, KvEventLog, block_hashes

    log = KvEventLog(window=4)
    for h in range(6):
        log.record(STORED, h)
    assert log.since(2) == [(STORED, h) for h in range(2, 6)]
    assert log.since(1) is None and log.since(7) is None and log.since(6) == []
    assert KvEventLog().epoch != log.epoch
    assert block_hashes([1, 2, 3, 4, 5], 2) == block_hashes([1, 2, 3, 4], 2)  # partial blocks are not hashed
    assert block_hashes([9, 2, 3, 4], 2)[1] != block_hashes([1, 2, 3, 4], 2)[1]  # a block's hash covers its prefix
