"""One run: the router and the controller on the calling thread, the replicas stepping on theirs. Every tick it
reads the fleet's signals, calls the operator's `decide()` and carries the decision out."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from overlap.bench.control_replay.fleet import Replica, least_loaded
from overlap.bench.control_replay.plan import PROGRESS_EVERY_S, SIGNAL_WINDOW_S, RunPlan, Setup
from overlap.bench.report import RequestRecord, RunResult
from overlap.bench.traces import Trace
from overlap.bench.workload import fit_to_context, prompt_token_ids
from overlap.engine.config import EngineConfig


@dataclass(slots=True)
class Tick:
    t: float
    arrival_rate: float  # requests submitted per second since the previous tick
    ready: int
    replicas: int  # asked for (ready + starting)
    queue_depth: float
    action: str
    floor: int | None = None  # the predictive floor (overlap's run)
    forecast: float | None = None  # the arrival rate the floor expected one horizon ahead (req/s)


@dataclass(slots=True)
class ControlRun:
    """One run's result: the request records (for report.compute_metrics) plus what the control loop did."""

    result: RunResult
    ticks: list[Tick] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    replica_seconds: float = 0.0
    final_knobs: dict = field(default_factory=dict)
    submit_lag_ms: dict = field(default_factory=dict)  # how late the router submitted arrivals (host keeping up)
    cpu_share: float = 0.0  # process CPU seconds / wall seconds (2.0 = both cores busy)
    static_replicas: int | None = None  # a fixed fleet's size; None for a run that scales


def prepare_requests(trace: Trace, seed: int, max_model_len: int = 2048) -> list[tuple[list[int], int]]:
    """(prompt ids, max tokens) per request, the same for every run."""
    return [
        fit_to_context(prompt_token_ids(r, i, seed, vocab_size=8192), r.max_tokens, max_model_len)
        for i, r in enumerate(trace.requests)
    ]


class _Loop:
    """The router and the controller of one run, on the calling thread; replicas step on their own threads."""

    def __init__(self, setup: Setup, plan: RunPlan, prepared: list[tuple[list[int], int]]) -> None:
        from overlap.operator.control.policy import History

        self.setup, self.plan, self.prepared = setup, plan, prepared
        self.trace = setup.trace
        self.policy = setup.policy(plan)
        self.baseline = None
        if plan.controller not in ("static", "decide"):
            from overlap.bench.control_replay import baselines

            self.baseline = baselines.make(
                plan.controller,
                setup.time_scale,
                setup.min_replicas,
                setup.max_replicas,
                setup.ttft_slo_s,
                setup.tpot_slo_s,
            )
        self.knobs = EngineConfig(max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=2048, num_buffers=2).live
        # the history must reach back over a whole load period for the daily profile
        keep_s = max(900 / setup.time_scale, 1.1 * setup.period_s if setup.period_s < 1e5 else 0)
        self.history = History(
            keep_s=keep_s, scaling=self.policy.scaling, signal_window_s=self.policy.tuning.signal_window_s
        )
        self.signal_window_s = SIGNAL_WINDOW_S / setup.time_scale
        self.records = [
            RequestRecord(f"r{i}", r.arrival_s, num_prompt_tokens=len(p[0]))
            for i, (r, p) in enumerate(zip(self.trace.requests, prepared, strict=True))
        ]
        # (finished, e2e, queued, ttft, time per output token) per request
        self.recent: deque[tuple[float, float, float, float, float | None]] = deque()
        self.fleet: list[Replica] = []
        self.arrivals: deque[float] = deque()  # router times of the arrivals in the signal window
        self.run = ControlRun(RunResult(plan.label, "in-process", {}, self.records, 0.0, 0.0))
        if plan.controller == "static":
            self.run.static_replicas = plan.initial_replicas
        self.num_submitted = 0
        self._submitted_at_last_tick = 0
        self._last_tick = 0.0
        self.start = time.monotonic()

    def clock(self) -> float:
        return time.monotonic() - self.start

    def on_finished(self, out) -> None:
        """A replica thread reports a finished request (deque appends are thread-safe)."""
        rec, times = self.records[int(out.request_id[1:])], out.times
        rec.num_output_tokens = out.num_output_tokens
        rec.detail = str(out.finish_reason)
        if out.error or out.finish_reason.value not in ("stop", "length"):
            rec.status = "failed" if out.error else "rejected"
            return
        start = self.start
        rec.first_scheduled = None if times.first_scheduled is None else times.first_scheduled - start
        rec.first_token = None if times.first_token is None else times.first_token - start
        rec.finished = (times.finished or time.monotonic()) - start
        rec.status = "finished"
        queued = (rec.first_scheduled if rec.first_scheduled is not None else rec.finished) - rec.arrived
        ttft = (rec.first_token if rec.first_token is not None else rec.finished) - rec.arrived
        tpot = None
        if rec.first_token is not None and out.num_output_tokens > 1:
            tpot = (rec.finished - rec.first_token) / (out.num_output_tokens - 1)
        self.recent.append((rec.finished, rec.finished - rec.arrived, queued, ttft, tpot))

    def add_replica(self, cold: bool) -> None:
        name = f"{self.plan.label}-{len(self.fleet)}"
        ready_at = self.clock() + (self.setup.cold_start_s if cold else 0.0)
        self.fleet.append(Replica(name, self.setup, self.knobs, self.clock, ready_at, self.on_finished))

    def route(self, i: int, now: float, sampling_cls, invalid_error) -> None:
        """Send request i to the ready replica with the fewest outstanding requests."""
        rec = self.records[i]
        target = least_loaded(self.fleet, now)
        if target is None:  # cannot happen with min_replicas >= 1 warm at the start; kept as a visible outcome
            rec.status, rec.detail = "rejected", "no ready replica"
            return
        tokens, max_tokens = self.prepared[i]
        sampling = sampling_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        try:
            target.submit(rec.request_id, tokens, sampling, arrival_time=self.start + rec.arrived)
        except invalid_error as exc:
            rec.status, rec.detail = "rejected", str(exc)

    def signals(self, now: float):
        from overlap.operator.control.policy import Signals

        ready = [r for r in self.fleet if r.is_ready(now)]
        stats = [r.engine.stats() for r in ready]
        elapsed = max(now - self._last_tick, 1e-9)
        busy = [min(1.0, r.busy_since_last() / elapsed) for r in ready]
        if not self.run.ticks:  # no rate before a second reading (Prometheus has no series yet either)
            busy = []
        while self.recent and self.recent[0][0] < now - self.signal_window_s:
            self.recent.popleft()
        window = list(self.recent)
        e2e = [w[1] for w in window]
        tpots = [w[4] for w in window if w[4] is not None]
        # arrivals over the same trailing window as the latency signals (the operator's rate() over a counter)
        while self.arrivals and self.arrivals[0] < now - self.signal_window_s:
            self.arrivals.popleft()
        span = min(self.signal_window_s, max(now, 1e-9))
        return Signals(
            time=now,
            ready_replicas=len(ready),
            queue_depth=float(sum(s["num_waiting"] for s in stats)) if ready else None,
            device_busy=float(np.mean(busy)) if busy else None,
            queue_time_share=sum(w[2] for w in window) / sum(e2e) if e2e and sum(e2e) > 0 else None,
            p99_latency_s=float(np.percentile(e2e, 99)) if e2e else None,
            ttft_p99_s=float(np.percentile([w[3] for w in window], 99)) if window else None,
            kv_cache_usage=max(s["kv_usage"] for s in stats) if stats else None,
            arrival_rate=len(self.arrivals) / span if self.run.ticks else None,
            finish_rate=len(window) / span if self.run.ticks else None,
            running=float(sum(s["num_running"] for s in stats)) if ready else None,
            batch_size=float(np.mean([s["avg_batch_size"] for s in stats])) if stats else None,
            ttft_p90_s=float(np.percentile([w[3] for w in window], 90)) if window else None,
            itl_p90_s=float(np.percentile(tpots, 90)) if tpots else None,
        )

    def tick(self, now: float) -> None:
        """Read the signals, decide, carry the decision out, remember it."""
        from overlap.operator.control.decide import decide
        from overlap.operator.control.policy import RETUNE, SCALE_DOWN, SCALE_UP, Current, Decision

        signals = self.signals(now)
        asked = [r for r in self.fleet if r.is_asked_for]
        decision = decide(signals, Current(len(asked), self.knobs), self.history, self.policy)
        if self.baseline is not None:
            target, why = self.baseline.target(signals, len(asked))
            action = SCALE_UP if target > len(asked) else SCALE_DOWN if target < len(asked) else "hold"
            decision = Decision(action, f"{self.plan.label}: {why}", target, self.knobs)
        if decision.action == SCALE_UP:
            for _ in range(decision.replicas - len(asked)):
                self.add_replica(cold=True)
        elif decision.action == SCALE_DOWN:
            # cancel a replica still starting first (it holds nothing), else drain the least loaded ready one
            victims = sorted(asked, key=lambda r: (now >= r.ready_at, r.outstanding))
            for replica in victims[: len(asked) - decision.replicas]:
                replica.drain(now)
        elif decision.action == RETUNE:
            self.knobs = decision.engine
            for replica in asked:
                replica.engine.reconfigure(self.knobs)
        self.history.record(signals, decision)
        if decision.action != "hold":
            entry = {"t": round(now, 3), "action": decision.action, "replicas": decision.replicas}
            if decision.floor is not None:
                entry["floor"] = decision.floor
            self.run.decisions.append({**entry, "reason": decision.reason})
            self.setup.say(
                f"  {self.plan.label} t={now:5.1f} s {decision.action} -> {decision.replicas}: {decision.reason}",
            )
        elapsed = max(now - self._last_tick, 1e-9)
        rate = (self.num_submitted - self._submitted_at_last_tick) / elapsed if self.run.ticks else 0.0
        ready = sum(r.is_ready(now) for r in self.fleet)
        self.run.ticks.append(
            Tick(
                now,
                rate,
                ready,
                len([r for r in self.fleet if r.is_asked_for]),
                signals.queue_depth or 0.0,
                decision.action,
                decision.floor,
                self.history.expected_rate(now),
            )
        )
        self._submitted_at_last_tick, self._last_tick = self.num_submitted, now

    def replay(self) -> ControlRun:
        from overlap.engine import InvalidRequestError, SamplingParams

        setup, trace, records = self.setup, self.trace, self.records
        for _ in range(self.plan.initial_replicas):
            self.add_replica(cold=False)  # the run starts with a warm fleet
        interval = setup.interval_s
        lags: list[float] = []
        next_tick, next_progress = 0.0, PROGRESS_EVERY_S
        submit_end: float | None = None
        cpu0 = time.process_time()
        self.start = time.monotonic()
        for replica in self.fleet:
            replica.created = replica.ready_at = 0.0
        while True:
            now = self.clock()
            while self.num_submitted < len(records) and trace.requests[self.num_submitted].arrival_s <= now:
                self.route(self.num_submitted, now, SamplingParams, InvalidRequestError)
                self.arrivals.append(now)
                lags.append(now - trace.requests[self.num_submitted].arrival_s)
                self.num_submitted += 1
            if submit_end is None and self.num_submitted == len(records):
                submit_end = now
            if now >= next_tick:
                self.tick(now)
                next_tick = max(next_tick + interval, now)
            if now >= next_progress:
                next_progress += PROGRESS_EVERY_S
                self.progress(now)
            if submit_end is not None:
                working = any(r.engine.has_unfinished() for r in self.fleet if r.stopped is None)
                if not working or now > submit_end + setup.drain_s:
                    break
            upcoming = trace.requests[self.num_submitted].arrival_s if self.num_submitted < len(records) else math.inf
            time.sleep(min(0.002, max(0.0, min(upcoming, next_tick) - self.clock())))
        wall = self.clock()
        run = self.run
        run.cpu_share = (time.process_time() - cpu0) / wall
        for replica in self.fleet:
            replica.close()
        run.replica_seconds = sum(r.lifetime(wall) for r in self.fleet)
        run.final_knobs = self.knobs.to_dict()
        run.submit_lag_ms = {
            "p99": float(np.percentile(lags, 99) * 1000) if lags else 0.0,
            "max": max(lags, default=0.0) * 1000,
        }
        run.result.wall_s = wall
        run.result.submit_end_s = submit_end if submit_end is not None else wall
        run.result.config = {"knobs_final": run.final_knobs}
        return run

    def progress(self, now: float) -> None:
        done = sum(r.num_finished for r in self.fleet)
        last = self.run.ticks[-1] if self.run.ticks else None
        ready, asked, waiting = (last.ready, last.replicas, last.queue_depth) if last else (0, 0, 0.0)
        self.setup.say(
            f"  {self.plan.label} t={now:5.1f} s: submitted {self.num_submitted}/{len(self.records)}, finished {done}, "
            f"{ready} replicas ready of {asked}, {waiting:.0f} waiting",
        )


def run_control(setup: Setup, plan: RunPlan, prepared: list[tuple[list[int], int]]) -> ControlRun:
    """Replay the trace on a fleet driven by `decide()` (see the module docstring)."""
    return _Loop(setup, plan, prepared).replay()
