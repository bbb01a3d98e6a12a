"""A stateful test of queue, scheduler, block manager and executor together (hypothesis' RuleBasedStateMachine):
requests added (some forks of another's prompt, as for `n > 1`, some sharing a prefix), aborted, preempted, live
reconfiguration (batch limits, the number of steps in flight, the aging period), steps that fail and time passing
(the engine runs on the test's clock), in any order. After every rule: nothing runs twice or both runs and waits,
the block manager's invariants hold. After every step: the requests it admitted were the head of the queue as it
stood (priority levels, FIFO within one: nothing jumped it), and no waiting request sits above the level aging
guarantees (one level up per `aging_s` waited). At the end every request has ended exactly once, with the
reference tokens unless it was aborted or in a failed step (then a prefix of them), and every KV block is back."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from overlap.engine.requests.request import RequestStatus
from overlap.engine.types import FinishReason, RequestSpec, SamplingParams
from tests.support.engine import create_engine, reference_tokens

NUM_BLOCKS = 12  # of 4 slots: decode growth often forces preemptions
# What the runs exercised, summed over them: the scenario must have hit the prefix cache and preempted, not only
# been able to.
COVERED = {"runs": 0, "prefix_cache_hits": 0, "preemptions": 0}
SHARED = [9, 8, 7, 6, 5, 4, 3, 2]  # a common prefix: prefix-cache hits
AGING_S = 1.0
STEP_S = 0.1  # the test's clock advances this much per engine step: requests that wait many steps age


class EngineMachine(RuleBasedStateMachine):
    @initialize(chunked=st.booleans(), buffers=st.sampled_from([1, 2]), policy=st.sampled_from(["priority", "fifo"]))
    def start(self, chunked: bool, buffers: int, policy: str) -> None:
        self.chunked = chunked
        self.now = 0.0
        self.engine = create_engine(
            num_blocks=NUM_BLOCKS, block_size=4, max_model_len=64, max_seq_len=64, max_num_seqs=6,
            max_num_batched_tokens=8 if chunked else 64, enable_chunked_prefill=chunked, enable_prefix_caching=True,
            queue_policy=policy, num_buffers=buffers, aging_s=AGING_S, clock=lambda: self.now,
        )  # fmt: skip
        self.aging_s = AGING_S
        self.added: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: set[str] = set()
        self.outputs: dict[str, list] = {}
        # request id -> (when it entered the queue, the level it entered at, its preemption count then)
        self.queued: dict[str, tuple[float, int, int]] = {}
        self.schedules = 0
        schedule = self.engine.scheduler.schedule

        def counted(now):
            self.schedules += 1
            return schedule(now)

        self.engine.scheduler.schedule = counted

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
        self.engine.add_request(RequestSpec(rid, prompt, sampling, priority=priority))
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
        self.engine.add_request(RequestSpec(rid, self.added[parent][0], sampling, share_prompt_with=parent))
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
            self._step()

    @rule(periods=st.sampled_from([0.25, 1.0, 2.5]))
    def wait(self, periods) -> None:
        self.now += periods * self.aging_s

    def _step(self) -> None:
        """One engine step, checking the queue's order and the aging bound around it."""
        self.now += STEP_S
        waiting = self.engine.scheduler.waiting
        aged = copy.deepcopy(waiting)
        aged.update(self.now)  # the order the step's schedule sees once it has applied aging
        queued = {r.request_id: (r, r.times.num_preemptions) for r in waiting}
        schedules = self.schedules
        self._collect(self.engine.step())

        def admitted(rid: str) -> bool:  # left the queue for good, or left it and was preempted back in the step
            request, preemptions = queued[rid]
            return rid not in waiting or request.times.num_preemptions != preemptions

        left = [(admitted(r.request_id), r.queue_level) for r in aged if r.request_id not in self.aborted]
        assert [a for a, _ in left] == sorted((a for a, _ in left), reverse=True), "admitted ahead of the queue's head"
        levels_in, levels_out = [lv for a, lv in left if a], [lv for a, lv in left if not a]
        assert not (levels_in and levels_out) or max(levels_in) <= min(levels_out), "a lower level admitted first"
        if self.schedules > schedules:  # aging is applied when a step is scheduled
            self._check_aging(waiting)

    def _check_aging(self, waiting) -> None:
        """Each waiting request is at most `entry level - whole aging periods waited` (never below 0); the queue
        scans for due requests at most 100 times a period, so one may be that late."""
        queued = {}
        for request in waiting:
            rid, count = request.request_id, request.times.num_preemptions
            entered, level, seen = self.queued.get(rid, (self.now, request.queue_level, count))
            if seen != count:  # preempted since: queued anew
                entered, level = self.now, request.queue_level
            queued[rid] = (entered, level, count)
            if waiting.aging_s is not None:
                periods = int((self.now - entered - self.aging_s / 100) // self.aging_s)
                bound = max(0, level - max(0, periods))
                assert request.queue_level <= bound, f"{rid} waited {self.now - entered} s at level {level}"
        self.queued = queued

    @rule(ahead=st.integers(0, 2))
    def fail_a_step(self, ahead) -> None:
        runner = self.engine.runner
        runner.fail_calls[runner.calls + ahead] = RuntimeError("injected step failure")

    @rule(max_num_seqs=st.integers(1, 8), budget=st.sampled_from([4, 8, 64]), buffers=st.sampled_from([1, 2, 3]),
          aging_s=st.sampled_from([0.5, 1.0, 2.0]))  # fmt: skip
    def reconfigure(self, max_num_seqs, budget, buffers, aging_s) -> None:
        budget = max(budget, 1 if self.chunked else 64)
        live = self.engine.config.live
        self.engine.reconfigure(live.replace(max_num_seqs=max_num_seqs, num_buffers=buffers, aging_s=aging_s,
                                             max_num_batched_tokens=budget))  # fmt: skip
        # The bound restarts from here under the new period: a request's level now, one up per period from now.
        self.aging_s = aging_s
        self.queued = {r.request_id: (self.now, r.queue_level, r.times.num_preemptions)
                       for r in self.engine.scheduler.waiting}  # fmt: skip

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
            self._step()
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
        COVERED["runs"] += 1
        COVERED["prefix_cache_hits"] += engine.stats()["prefix_cache_hits_total"]
        COVERED["preemptions"] += engine.stats()["num_preemptions_total"]
        engine.executor.close()


EngineMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.reliability
def test_engine_state_machine(reliability) -> None:
    before = dict(COVERED)
    EngineMachine.TestCase("runTest").runTest()
    covered = {key: COVERED[key] - before[key] for key in COVERED}
    assert covered["prefix_cache_hits"] > 0 and covered["preemptions"] > 0, covered
    reliability.row(
        "Engine", "any interleaving of add (3 priorities), fork (n > 1), abort, preempt, reconfigure (aging period "
        "too), failing steps and time passing",
        load="120 hypothesis runs of up to 40 rules, 1-3 steps in flight, 12 KV blocks, the engine on the test's clock",
        outcome="after every rule nothing runs twice, block invariants hold; each step admits only the queue's head "
        "(levels, then FIFO) and no request waits above its aging bound; at the end each request ended once, tokens "
        f"equal to the reference (a prefix if aborted or failed), every block back; {covered['prefix_cache_hits']} "
        f"prefix-cache hits and {covered['preemptions']} preemptions over its {covered['runs']} runs",
    )  # fmt: skip
