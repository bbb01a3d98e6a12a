"""Scheduler on the fake runner: batch shape, chunked prefill, preemption, priorities, aging, deadlines."""

from __future__ import annotations

from overlap.engine.requests.request import RequestStatus
from overlap.engine.types import FinishReason
from tests.support.engine import create_requests, create_scheduler, reference_tokens, run_step


def _run_all(scheduler, runner, now: float = 0.0, dt: float = 0.01, max_steps: int = 10_000) -> float:
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return now
        run_step(scheduler, runner, now)
        now += dt
    raise AssertionError("scheduler did not drain")


def test_decodes_first_then_prefill_chunks_under_the_token_budget() -> None:
    scheduler, runner = create_scheduler(max_num_batched_tokens=10)
    a, b = create_requests(2, prompt_len=4, max_tokens=20)
    for r in (a, b):
        scheduler.add_request(r, 0.0)
    run_step(scheduler, runner, 0.0)  # both prompts (8 tokens) fit one step
    (long,) = create_requests(1, prompt_len=30)
    scheduler.add_request(long, 0.1)
    batch, _ = run_step(scheduler, runner, 0.1)
    seqs = batch.model_input.seqs
    # Decodes were scheduled first (1 token each), the new prompt got the remaining 8 tokens as a chunk;
    # the runner sees prefill chunks first, then decodes.
    assert [(s.request_id, len(s.token_ids)) for s in seqs] == [
        (long.request_id, 8),
        (a.request_id, 1),
        (b.request_id, 1),
    ]
    assert batch.model_input.num_tokens == 10
    assert not seqs[0].do_sample and seqs[1].do_sample


def test_sequence_cap_limits_the_running_set() -> None:
    scheduler, runner = create_scheduler(max_num_seqs=3)
    requests = create_requests(5, prompt_len=3, max_tokens=4)
    for r in requests:
        scheduler.add_request(r, 0.0)
    batch, _ = run_step(scheduler, runner, 0.0)
    assert len(batch.requests) == 3 and len(scheduler.running) == 3 and len(scheduler.waiting) == 2
    _run_all(scheduler, runner)
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests)


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end() -> None:
    scheduler, runner = create_scheduler(max_num_batched_tokens=8)
    (r,) = create_requests(1, prompt_len=25, max_tokens=3)
    scheduler.add_request(r, 0.0)
    _run_all(scheduler, runner)
    chunks = [(s.start_pos, len(s.token_ids), s.do_sample) for b in runner.batches for s in b.seqs]
    assert chunks[:4] == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 1, True)]
    assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling)


def test_without_chunked_prefill_a_prompt_runs_whole_and_waits_for_room() -> None:
    scheduler, runner = create_scheduler(
        max_num_batched_tokens=32, max_seq_len=32, enable_chunked_prefill=False, num_blocks=64
    )
    a, b = create_requests(2, prompt_len=20, max_tokens=4)
    scheduler.add_request(a, 0.0)
    scheduler.add_request(b, 0.0)
    batch, _ = run_step(scheduler, runner, 0.0)
    assert [(s.request_id, len(s.token_ids)) for s in batch.model_input.seqs] == [(a.request_id, 20)]
    batch, _ = run_step(scheduler, runner, 0.1)  # a decodes (1) and b's 20 tokens now fit (21 <= 32)
    assert sorted(len(s.token_ids) for s in batch.model_input.seqs) == [1, 20]
    _run_all(scheduler, runner)
    for r in (a, b):
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling)


def test_out_of_blocks_preempts_the_lowest_priority_latest_and_resumes_it_exactly() -> None:
    # 12 blocks of 4 slots: three 8-token prompts (2 blocks each) fit, but not their 16 decode tokens each.
    scheduler, runner = create_scheduler(num_blocks=12, block_size=4, enable_prefix_caching=False)
    high = create_requests(1, prompt_len=8, max_tokens=16, priority=0, arrived=0.0)[0]
    early_low = create_requests(1, prompt_len=8, max_tokens=16, priority=2, arrived=1.0)[0]
    late_low = create_requests(1, prompt_len=8, max_tokens=16, priority=2, arrived=2.0)[0]
    for r in (late_low, high, early_low):
        scheduler.add_request(r, 0.0)
    first_victim = None
    now = 0.0
    while scheduler.num_unfinished:
        batch, _ = run_step(scheduler, runner, now)
        if batch.preempted and first_victim is None:
            first_victim = batch.preempted[0]
        now += 0.01
        scheduler.block_manager.check_invariants(scheduler.running)
    assert first_victim is late_low
    assert late_low.times.num_preemptions >= 1 and high.times.num_preemptions == 0
    assert scheduler.num_preemptions_total >= 1
    for r in (high, early_low, late_low):
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling), r.request_id
    assert scheduler.block_manager.num_free_blocks == 12


def test_a_high_priority_request_behind_100_low_priority_ones_runs_first() -> None:
    scheduler, runner = create_scheduler(max_num_seqs=1)
    lows = create_requests(100, prompt_len=4, max_tokens=2, priority=2)
    for r in lows:
        scheduler.add_request(r, 0.0)
    (high,) = create_requests(1, prompt_len=4, max_tokens=2, priority=0)
    scheduler.add_request(high, 0.0)
    batch, _ = run_step(scheduler, runner, 0.0)
    assert [r.request_id for r in batch.requests] == [high.request_id]


def test_a_higher_priority_arrival_preempts_lower_priority_work_for_kv_blocks() -> None:
    scheduler, runner = create_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    lows = create_requests(2, prompt_len=12, max_tokens=4, priority=2)  # 3 blocks each: 6 of 8 used
    for r in lows:
        scheduler.add_request(r, 0.0)
    run_step(scheduler, runner, 0.0)
    (high,) = create_requests(1, prompt_len=12, max_tokens=4, priority=0)  # needs 3, only 2 free
    scheduler.add_request(high, 0.1)
    batch, _ = run_step(scheduler, runner, 0.1)
    assert batch.preempted == [lows[1]]  # the latest low-priority one
    assert high.status is RequestStatus.RUNNING
    assert lows[1].request_id not in {r.request_id for r in batch.requests}
    _run_all(scheduler, runner, now=0.2)
    for r in [*lows, high]:
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling)


def _stream(aging_s: float, sim_seconds: float) -> float | None:
    """A saturating stream of priority-0 requests (one arrives per step and each takes one step) plus one
    priority-2 request at t=0. Returns the low-priority request's finish time, or None."""
    step = 0.1
    scheduler, runner = create_scheduler(max_num_seqs=1, aging_s=aging_s)
    runner.keep_batches = False
    (low,) = create_requests(1, prompt_len=4, max_tokens=1, priority=2, arrived=0.0)
    scheduler.add_request(low, 0.0)
    for r in create_requests(5, prompt_len=4, max_tokens=1, priority=0, arrived=0.0):  # a standing backlog
        scheduler.add_request(r, 0.0)
    now = 0.0
    while now < sim_seconds:
        scheduler.add_request(create_requests(1, prompt_len=4, max_tokens=1, priority=0, arrived=now)[0], now)
        run_step(scheduler, runner, now)
        if low.is_finished:
            return low.times.finished
        now += step
    return None


def test_aging_bounds_the_wait_of_low_priority_work_under_a_steady_high_priority_stream() -> None:
    # Without aging the low-priority request starves for the whole run.
    assert _stream(aging_s=1e9, sim_seconds=60.0) is None
    # The bound: (num_levels - 1) * aging_s to reach level 0, then at most the level-0 backlog present at that
    # moment (here 5 standing + 1 new per step, each served in one 0.1 s step) ahead of it:
    # 2 * 1.0 s + (5 + 2) * 0.1 s = 2.7 s.
    finished = _stream(aging_s=1.0, sim_seconds=60.0)
    assert finished is not None and finished <= 2 * 1.0 + 7 * 0.1 + 1e-9


def test_queued_requests_past_their_deadline_finish_with_timeout() -> None:
    scheduler, runner = create_scheduler(batching="serial")
    (busy,) = create_requests(1, prompt_len=4, max_tokens=50)
    (late,) = create_requests(1, prompt_len=4, max_tokens=2, deadline=0.35)
    scheduler.add_request(busy, 0.0)
    scheduler.add_request(late, 0.0)
    now = 0.0
    timed_out = []
    while now < 1.0:
        batch, _ = run_step(scheduler, runner, now)
        timed_out += batch.finished
        now += 0.1
    assert timed_out == [late]
    assert late.finish_reason is FinishReason.TIMEOUT and late.status is RequestStatus.FINISHED_TIMEOUT
    assert 0.35 <= late.times.finished < 0.5
    assert late.request_id not in scheduler.waiting


def test_serial_policy_admits_one_request_at_a_time() -> None:
    scheduler, runner = create_scheduler(batching="serial")
    requests = create_requests(3, prompt_len=4, max_tokens=3)
    for r in requests:
        scheduler.add_request(r, 0.0)
    now = 0.0
    while scheduler.num_unfinished:
        batch, _ = run_step(scheduler, runner, now)
        assert len(batch.requests) <= 1
        now += 0.01
    assert [r.times.first_scheduled for r in requests] == sorted(r.times.first_scheduled for r in requests)


def test_abort_queued_and_running() -> None:
    scheduler, runner = create_scheduler(max_num_seqs=1)
    running, queued = create_requests(2, prompt_len=8, max_tokens=10)
    scheduler.add_request(running, 0.0)
    scheduler.add_request(queued, 0.0)
    run_step(scheduler, runner, 0.0)
    assert scheduler.abort(queued.request_id, 0.1) is queued
    assert scheduler.abort(running.request_id, 0.1) is running
    assert scheduler.abort("nope", 0.1) is None
    assert running.finish_reason is FinishReason.ABORT and queued.finish_reason is FinishReason.ABORT
    assert scheduler.num_unfinished == 0
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_repeated_prompt_hits_the_prefix_cache_with_identical_outputs() -> None:
    scheduler, runner = create_scheduler(block_size=4)
    first, second = create_requests(2, prompt_len=18, max_tokens=6, same_prompt=True)
    scheduler.add_request(first, 0.0)
    _run_all(scheduler, runner)
    scheduler.add_request(second, 1.0)
    _run_all(scheduler, runner, now=1.0)
    assert second.num_cached_tokens == 16
    assert second.output_token_ids == first.output_token_ids == reference_tokens(first.prompt_token_ids, first.sampling)
    assert scheduler.block_manager.prefix_cache_hits == 16


def test_fifo_ignores_priority_when_choosing_a_preemption_victim() -> None:
    scheduler, runner = create_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False, queue_policy="fifo")
    first_low = create_requests(1, prompt_len=12, max_tokens=8, priority=2, arrived=0.0)[0]
    later_high = create_requests(1, prompt_len=12, max_tokens=8, priority=0, arrived=1.0)[0]
    for r in (first_low, later_high):
        scheduler.add_request(r, 0.0)
    victims = []
    now = 0.0
    while scheduler.num_unfinished:
        batch, _ = run_step(scheduler, runner, now)
        victims += batch.preempted
        now += 0.01
    assert victims and victims[0] is later_high  # the latest arrival, although it has the higher priority
    for r in (first_low, later_high):
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling)


def test_dynamic_batching_waits_for_a_full_batch_or_the_oldest_waiter() -> None:
    scheduler, runner = create_scheduler(batching="dynamic", batching_args={"max_batch": 4, "max_wait_ms": 100})
    requests = create_requests(3, prompt_len=4, max_tokens=2, arrived=0.0)
    for r in requests:
        scheduler.add_request(r, 0.0)
    batch, _ = run_step(scheduler, runner, 0.05)
    assert batch.is_empty  # 3 < max_batch and the oldest has waited 50 ms < 100 ms
    batch, _ = run_step(scheduler, runner, 0.1)
    assert len(batch.requests) == 3
    late = create_requests(4, prompt_len=4, max_tokens=2, arrived=0.1)
    for r in late:
        scheduler.add_request(r, 0.1)
    batch, _ = run_step(scheduler, runner, 0.11)  # the running batch must finish before the next one starts
    assert {r.request_id for r in batch.requests} == {r.request_id for r in requests}
    _run_all(scheduler, runner, now=0.12)
    assert {r.times.first_scheduled for r in late} == {late[0].times.first_scheduled}  # one batch of 4


def test_fixed_window_holds_arrivals_until_their_window_closes() -> None:
    scheduler, runner = create_scheduler(batching="fixed_window", batching_args={"window_ms": 50})
    first = create_requests(2, prompt_len=4, max_tokens=2, arrived=0.0)
    for r in first:
        scheduler.add_request(r, 0.0)
    assert run_step(scheduler, runner, 0.02)[0].is_empty
    batch, _ = run_step(scheduler, runner, 0.05)
    assert {r.request_id for r in batch.requests} == {r.request_id for r in first}
