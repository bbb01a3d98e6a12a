"""The fleet as a model in simulated time (`--fleet model`): the same router, signals, `decide()` and baselines as
the engine fleet (loop._Loop), with each replica a small model of the engine's continuous batching instead of a real
Engine on its own thread. Time is the model's own: a run takes what the host needs to compute it, not the trace's
length, and gives the same figures on a busy machine. The trace sweep (`overlap bench control-sweep`) runs on it.

A replica's step, as the engine's scheduler builds it: every running sequence decodes one token or takes the next
chunk of its prompt within the step budget (`max_num_batched_tokens`), then waiting requests join first come, first
served while the batch has room (`max_num_seqs`) and the budget lasts. The step takes the cost model's
`fixed + per_token x tokens`; the step that ends a prompt gives its first token. Not modelled: `num_buffers` (steps
run back to back), preemption (the KV pool, `KV_BLOCKS` of 16 tokens as the simulated runner has, is only read for
the kv_cache_usage signal), host time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from overlap.bench.control_replay.fleet import Pod, least_loaded
from overlap.bench.control_replay.loop import ControlRun, _Loop, prepare_requests
from overlap.bench.control_replay.plan import PROGRESS_EVERY_S, RunPlan, Setup
from overlap.bench.workload import fit_to_context
from overlap.engine.config import LiveKnobs
from overlap.engine.types import FinishReason

KV_BLOCKS, BLOCK_SIZE = 4096, 16  # the simulated runner's pool (Engine.stats() num_kv_blocks on a SimRunner)
STATS_STEPS = 128  # the engine's window for avg_batch_size (core._WINDOW_STEPS)


@dataclass(slots=True)
class _Seq:
    index: int  # the request's index in the trace
    prompt_left: int
    output_left: int
    tokens: int  # held in the KV cache
    first_scheduled: float | None = None
    first_token: float | None = None


@dataclass(slots=True)
class _Times:
    first_scheduled: float | None
    first_token: float | None
    finished: float


@dataclass(slots=True)
class _Finished:
    """The fields of an engine output the loop's on_finished reads (a request ends at its max_tokens here)."""

    request_id: str
    num_output_tokens: int
    times: _Times
    finish_reason: FinishReason = FinishReason.LENGTH
    error: str | None = None


class ModelReplica(Pod):
    """One pod: its own `engine` (stats, reconfigure, has_unfinished) as the loop reads a real one."""

    def __init__(self, name: str, setup: Setup, knobs: LiveKnobs, created: float, ready_at: float,
                 on_finished) -> None:  # fmt: skip
        super().__init__(created, ready_at)
        self.name = name
        self.engine = self
        self.fixed_s, self.per_token_s = setup.cost_ms_us[0] / 1000, setup.cost_ms_us[1] / 1e6
        self.max_num_seqs, self.budget = knobs.max_num_seqs, knobs.max_num_batched_tokens
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.step_end: float | None = None  # when the step in flight ends; None: idle
        self._step: list[tuple[_Seq, int]] = []  # (sequence, tokens it runs) of the step in flight
        self._batches: deque[int] = deque(maxlen=STATS_STEPS)
        self.busy_s_total = self._busy_s_seen = 0.0
        self._on_finished = on_finished

    # ---- what the loop calls, as on a fleet.Replica ----------------------------------------------------------------
    def drain(self, now: float) -> None:
        self.draining = True
        if now < self.ready_at or not self.has_unfinished():
            self.stopped = now

    def busy_since_last(self) -> float:
        delta, self._busy_s_seen = self.busy_s_total - self._busy_s_seen, self.busy_s_total
        return delta

    def close(self) -> None:
        pass

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "kv_usage": sum(math.ceil(s.tokens / BLOCK_SIZE) for s in self.running) / KV_BLOCKS,
            "avg_batch_size": sum(self._batches) / max(len(self._batches), 1),
        }

    def reconfigure(self, knobs: LiveKnobs) -> None:
        self.max_num_seqs, self.budget = knobs.max_num_seqs, knobs.max_num_batched_tokens

    # ---- the model ----------------------------------------------------------------------------------------------
    def submit(self, index: int, prompt_tokens: int, max_tokens: int, now: float) -> None:
        self.waiting.append(_Seq(index, prompt_tokens, max_tokens, 0))
        self.num_submitted += 1
        if self.step_end is None:
            self._start_step(now)

    def _start_step(self, now: float) -> None:
        budget, step = self.budget, []
        for seq in self.running:
            n = 1 if seq.prompt_left == 0 else min(seq.prompt_left, budget)
            if n > 0:
                step.append((seq, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting.popleft()
            seq.first_scheduled = now
            n = min(seq.prompt_left, budget)
            self.running.append(seq)
            step.append((seq, n))
            budget -= n
        if not step:
            self.step_end = None
            return
        duration = self.fixed_s + self.per_token_s * (self.budget - budget)
        self._step, self.step_end = step, now + duration
        self.busy_s_total += duration
        self._batches.append(len(step))

    def end_step(self) -> None:
        """Carry out the step in flight at its end, then start the next one."""
        now = self.step_end
        done = []
        for seq, n in self._step:
            seq.tokens += n
            if seq.prompt_left:
                seq.prompt_left -= n
                if seq.prompt_left:
                    continue
                seq.first_token = now
            seq.output_left -= 1
            if seq.output_left == 0:
                done.append(seq)
        for seq in done:
            self.running.remove(seq)
            self.num_finished += 1
            self._on_finished(seq, now)
        self._start_step(now)
        if self.draining and not self.has_unfinished() and self.stopped is None:
            self.stopped = now


class _ModelLoop(_Loop):
    """The engine fleet's loop (signals, tick, decisions) over ModelReplicas, on the model's clock."""

    def __init__(self, setup: Setup, plan: RunPlan, prepared: list[tuple[list[int], int]]) -> None:
        super().__init__(setup, plan, prepared)
        self.lengths = [(len(tokens), max_tokens) for tokens, max_tokens in prepared]
        self.now = 0.0
        self.start = 0.0

    def clock(self) -> float:
        return self.now

    def add_replica(self, cold: bool) -> None:
        name = f"{self.plan.label}-{len(self.fleet)}"
        ready_at = self.now + (self.setup.cold_start_s if cold else 0.0)
        self.fleet.append(ModelReplica(name, self.setup, self.knobs, self.now, ready_at, self.finished))

    def finished(self, seq: _Seq, now: float) -> None:
        times = _Times(seq.first_scheduled, seq.first_token, now)
        self.on_finished(_Finished(f"r{seq.index}", self.lengths[seq.index][1], times))

    def route(self, i: int, now: float, sampling_cls=None, invalid_error=None) -> None:
        replica = least_loaded(self.fleet, now)
        if replica is None:
            self.records[i].status, self.records[i].detail = "rejected", "no ready replica"
            return
        replica.submit(i, *self.lengths[i], now)

    def replay(self) -> ControlRun:
        setup, requests = self.setup, self.trace.requests
        for _ in range(self.plan.initial_replicas):
            self.add_replica(cold=False)
        interval, next_tick, next_progress = setup.interval_s, 0.0, PROGRESS_EVERY_S
        end = requests[-1].arrival_s + setup.drain_s
        while True:
            steps = [(r.step_end, k, r) for k, r in enumerate(self.fleet) if r.step_end is not None]
            step_at, _, replica = min(steps, default=(math.inf, 0, None), key=lambda s: s[:2])
            arrival_at = requests[self.num_submitted].arrival_s if self.num_submitted < len(requests) else math.inf
            now = min(step_at, arrival_at, next_tick)
            if now > end or (now == math.inf):
                break
            self.now = now
            if now == step_at:
                replica.end_step()
            elif now == arrival_at:
                self.route(self.num_submitted, now)
                self.arrivals.append(now)
                self.num_submitted += 1
            else:
                self.tick(now)
                next_tick += interval
                if self.num_submitted == len(requests) and not any(r.has_unfinished() for r in self.fleet):
                    break
            if now >= next_progress:
                next_progress += PROGRESS_EVERY_S
                self.progress(now)
        wall = self.now
        run = self.run
        run.replica_seconds = sum(r.lifetime(wall) for r in self.fleet)
        run.final_knobs = self.knobs.to_dict()
        run.submit_lag_ms = {"p99": 0.0, "max": 0.0}
        run.result.wall_s = wall
        run.result.submit_end_s = requests[-1].arrival_s
        run.result.config = {"knobs_final": run.final_knobs, "fleet": "model"}
        return run


def prepare_lengths(trace, seed: int, max_model_len: int = 2048) -> list[tuple[range, int]]:
    """loop.prepare_requests' (prompt, max tokens) per request without drawing the ids: the model reads lengths only
    (a range stands for the prompt). A text prompt is tokenized as there."""
    if any(r.prompt_tokens is None for r in trace.requests):
        return prepare_requests(trace, seed, max_model_len)
    return [fit_to_context(range(r.prompt_tokens), r.max_tokens, max_model_len) for r in trace.requests]


def run_modelled(setup: Setup, plan: RunPlan, prepared: list[tuple[list[int], int]]) -> ControlRun:
    """Replay the trace on the modelled fleet (see the module docstring)."""
    return _ModelLoop(setup, plan, prepared).replay()
