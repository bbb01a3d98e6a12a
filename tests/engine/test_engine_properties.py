"""Property: after any sequence of add / abort / preempt / step / reconfigure, every KV block returns to the pool,
no request is lost or duplicated, and every completed request's tokens equal the serial reference."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from overlap.engine.requests.request import RequestStatus
from overlap.engine.types import FinishReason, RequestSpec, SamplingParams
from tests.support.engine import create_engine, reference_tokens

NUM_BLOCKS = 12  # of 4 slots: a request needs up to 10, so decode growth often forces preemptions

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 2),  # priority
    st.booleans(),  # share a common prefix with other requests (prefix-cache hits)
    st.booleans(),  # ignore_eos
)
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))
preempt_op = st.tuples(st.just("preempt"), st.integers(0, 50))
step_op = st.tuples(st.just("step"), st.integers(1, 4))
reconf_op = st.tuples(st.just("reconfigure"), st.integers(1, 8), st.sampled_from([4, 8, 64]))
ops_strategy = st.lists(
    st.one_of(add_op, add_op, abort_op, preempt_op, step_op, step_op, reconf_op), min_size=8, max_size=60
)


def _check_consistent(engine) -> None:
    scheduler = engine.scheduler
    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert len(set(running_ids)) == len(running_ids), "a request runs twice"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert len(waiting_ids) == len(set(waiting_ids))
    scheduler.block_manager.check_invariants(scheduler.running)
    num_preempted = sum(1 for r in scheduler.waiting if r.status is RequestStatus.PREEMPTED)
    assert scheduler.num_preempted == num_preempted == engine.stats()["num_preempted"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy, chunked=st.booleans(), prefix=st.booleans(), policy=st.sampled_from(["priority", "fifo"]))
def test_no_block_leak_no_lost_or_duplicated_request(ops, chunked, prefix, policy) -> None:
    engine = create_engine(
        num_blocks=NUM_BLOCKS,
        block_size=4,
        max_model_len=64,
        max_num_seqs=6,
        max_num_batched_tokens=64 if not chunked else 8,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=prefix,
        queue_policy=policy,
        max_seq_len=64,
    )
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    outputs: dict[str, list] = {}

    def collect(outs) -> None:
        for out in outs:
            assert out.request_id in added, "output for an unknown request"
            history = outputs.setdefault(out.request_id, [])
            assert not (history and history[-1].finished), "output after the final one"
            history.append(out)

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, length, max_tokens, priority, shared, ignore_eos = op
            rid = f"r{len(added)}"
            prompt = ([9, 8, 7, 6, 5, 4, 3, 2] if shared else []) + [
                (len(added) * 5 + j) % 60 + 2 for j in range(length)
            ]
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
            engine.add_request(RequestSpec(rid, prompt, sampling, priority=priority))
            added[rid] = (prompt, sampling)
        elif kind == "abort" and added:
            rid = f"r{op[1] % len(added)}"
            if engine.abort(rid):
                aborted.add(rid)
        elif kind == "preempt" and engine.scheduler.running:
            victim = engine.scheduler.running[op[1] % len(engine.scheduler.running)]
            assert engine.scheduler.preempt(victim.request_id, now=0.0)
        elif kind == "step":
            for _ in range(op[1]):
                collect(engine.step())
        elif kind == "reconfigure":
            budget = max(op[2], 64 if not chunked else 1)
            engine.reconfigure(engine.config.live.replace(max_num_seqs=op[1], max_num_batched_tokens=budget))
        _check_consistent(engine)

    for _ in range(5000):
        if not engine.has_unfinished():
            break
        collect(engine.step())
        _check_consistent(engine)
    assert not engine.has_unfinished(), "requests left unfinished"

    # Nothing lost, nothing duplicated: each request ends exactly once.
    assert set(outputs) == set(added)
    for rid, history in outputs.items():
        assert [o.finished for o in history].count(True) == 1 and history[-1].finished
        prompt, sampling = added[rid]
        tokens = [t for o in history for t in o.new_token_ids]
        expected = reference_tokens(prompt, sampling)
        reason = history[-1].finish_reason
        if rid in aborted and reason is FinishReason.ABORT:
            assert tokens == expected[: len(tokens)]
        else:
            assert reason in (FinishReason.LENGTH, FinishReason.STOP)
            assert tokens == expected, rid
    stats = engine.stats()
    event(f"preemptions: {'yes' if stats['num_preemptions_total'] else 'no'}")
    event(f"prefix-cache hits: {'yes' if stats['prefix_cache_hits_total'] else 'no'}")
    event(f"aborts: {'yes' if stats['requests_finished_total']['abort'] else 'no'}")
    # Every block is back.
    bm = engine.block_manager
    assert bm.num_free_blocks == NUM_BLOCKS
    bm.check_invariants([])
    assert not engine.scheduler.running and not engine.scheduler.waiting
