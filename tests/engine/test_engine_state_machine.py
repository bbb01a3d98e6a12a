"""A stateful test of queue, scheduler, block manager and executor together (hypothesis' RuleBasedStateMachine):
requests added (some forks of another's prompt, as for `n > 1`, some sharing a prefix), aborted, preempted, live
reconfiguration (batch limits and the number of steps in flight) and steps that fail, in any order. After every
rule: nothing runs twice or both runs and waits, the block manager's invariants hold; at the end every request has
ended exactly once, with the reference tokens unless it was aborted or in a failed step (then a prefix of them),
and every KV block is back."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from overlap.engine.requests.request import RequestStatus
from overlap.engine.types import FinishReason, SamplingParams
from tests.support.engine import create_engine, reference_tokens

NUM_BLOCKS = 12  # of 4 slots: decode growth often forces preemptions
SHARED = [9, 8, 7, 6, 5, 4, 3, 2]  # a common prefix: prefix-cache hits


class EngineMachine(RuleBasedStateMachine):
    @initialize(chunked=st.booleans(), buffers=st.sampled_from([1, 2]), policy=st.sampled_from(["priority", "fifo"]))
    def start(self, chunked: bool, buffers: int, policy: str) -> None:
        self.chunked = chunked
        self.engine = create_engine(
            num_blocks=NUM_BLOCKS, block_size=4, max_model_len=64, max_seq_len=64, max_num_seqs=6,
            max_num_batched_tokens=8 if chunked else 64, enable_chunked_prefill=chunked, enable_prefix_caching=True,
            queue_policy=policy, num_buffers=buffers,
        )  # fmt: skip
        self.added: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: set[str] = set()
        self.outputs: dict[str, list] = {}

    def _collect(self, outs) -> None:
        for out in outs:
            assert out.request_id in self.added, "output for an unknown request"
            history = self.outputs.setdefault(out.request_id, [])
            assert not (history and history[-1].finished), "output after the final one"
            history.append(out)

    @rule(length=st.integers(1, 20), max_tokens=st.integers(1, 12), priority=st.integers(0, 2), shared=st.booleans(),
          ignore_eos=st.booleans())  # fmt: skip
    def add(self, length, max_tokens, priority, shared, ignore_eos) -> None:
        rid = f"r{len(self.added)}"
        prompt = (SHARED if shared else []) + [(len(self.added) * 5 + j) % 60 + 2 for j in range(length)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
        self.engine.add_request(rid, prompt, sampling, priority=priority)
        self.added[rid] = (prompt, sampling)

    @precondition(lambda self: self.added)
    @rule(index=st.integers(0, 50), max_tokens=st.integers(1, 12))
    def fork(self, index, max_tokens) -> None:
        """Another sequence of a live request's prompt (how the sidecar runs `n > 1`): it reuses the prompt's
        blocks once they are computed."""
        live = [rid for rid in self.added if not (self.outputs.get(rid) and self.outputs[rid][-1].finished)]
        if not live:
            return
        parent = live[index % len(live)]
        rid = f"r{len(self.added)}"
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.engine.add_request(rid, self.added[parent][0], sampling, share_prompt_with=parent)
        self.added[rid] = (self.added[parent][0], sampling)

    @precondition(lambda self: self.added)
    @rule(index=st.integers(0, 50))
    def abort(self, index) -> None:
        rid = f"r{index % len(self.added)}"
        if self.engine.abort(rid):
            self.aborted.add(rid)

    @rule(index=st.integers(0, 50))
    def preempt(self, index) -> None:
        running = self.engine.scheduler.running
        if running and not self.engine.executor.num_in_flight:  # the engine preempts between steps only
            assert self.engine.scheduler.preempt(running[index % len(running)].request_id, now=0.0)

    @rule(steps=st.integers(1, 4))
    def step(self, steps) -> None:
        for _ in range(steps):
            self._collect(self.engine.step())

    @rule(ahead=st.integers(0, 2))
    def fail_a_step(self, ahead) -> None:
        runner = self.engine.runner
        runner.fail_calls[runner.calls + ahead] = RuntimeError("injected step failure")

    @rule(max_num_seqs=st.integers(1, 8), budget=st.sampled_from([4, 8, 64]), buffers=st.sampled_from([1, 2, 3]))
    def reconfigure(self, max_num_seqs, budget, buffers) -> None:
        self.engine.reconfigure(max_num_seqs=max_num_seqs, num_buffers=buffers,
                                max_num_batched_tokens=max(budget, 1 if self.chunked else 64))  # fmt: skip

    @invariant()
    def consistent(self) -> None:
        scheduler = self.engine.scheduler
        running = [r.request_id for r in scheduler.running]
        waiting = [r.request_id for r in scheduler.waiting]
        assert len(set(running)) == len(running), "a request runs twice"
        assert not set(running) & set(waiting), "a request both runs and waits"
        assert len(set(waiting)) == len(waiting), "a request waits twice"
        scheduler.block_manager.check_invariants(scheduler.running)
        assert scheduler.num_preempted == sum(1 for r in scheduler.waiting if r.status is RequestStatus.PREEMPTED)

    def teardown(self) -> None:
        engine = self.engine
        engine.runner.fail_calls.clear()
        for _ in range(5000):
            if not engine.has_unfinished():
                break
            self._collect(engine.step())
            self.consistent()
        assert not engine.has_unfinished(), "requests left unfinished"
        assert set(self.outputs) == set(self.added), "a request never ended"
        failed = engine.runner.failed_requests
        for rid, history in self.outputs.items():
            assert [o.finished for o in history].count(True) == 1, f"{rid} ended more than once"
            prompt, sampling = self.added[rid]
            tokens, expected = [t for o in history for t in o.new_token_ids], reference_tokens(prompt, sampling)
            reason = history[-1].finish_reason
            if reason is FinishReason.ABORT:
                assert rid in self.aborted and tokens == expected[: len(tokens)], rid
            elif reason is FinishReason.ERROR:
                assert rid in failed and tokens == expected[: len(tokens)], rid
            else:
                assert reason in (FinishReason.LENGTH, FinishReason.STOP) and tokens == expected, rid
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS, "KV blocks leaked"
        engine.block_manager.check_invariants([])
        engine.executor.close()


EngineMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.reliability
def test_engine_state_machine(reliability) -> None:
    EngineMachine.TestCase("runTest").runTest()
    reliability.row(
        "Engine", "any interleaving of add, fork (n > 1), abort, preempt, reconfigure and failing steps",
        load="120 hypothesis runs of up to 40 rules, 1-3 steps in flight, 12 KV blocks",
        outcome="after every rule nothing runs twice, block invariants hold; at the end each request ended once, "
        "tokens equal to the reference (a prefix if aborted or failed), every block back",
    )  # fmt: skip
