"""`overlap bench control`: the operator's control loop, closed, on a trace replayed against simulated replicas.

A fleet of replicas, each a real Engine (scheduler, request queue, KV block manager) on the simulated device
(`SimRunner`, asynchronous: the device runs steps on its own clock and the engine thread waits without the GIL),
each driven by its own thread. A router in front sends every arrival to the ready replica with the fewest
outstanding requests (join-shortest-queue). Every tick the loop reads the fleet's signals with the meaning of the
operator's Prometheus queries, calls the operator's own `decide()` (overlap.operator.control.policy) and carries the
decision out: a new replica serves only after a cold start; a removed one stops receiving, finishes what it holds,
then goes, so nothing accepted is lost; a retune goes to every replica through `Engine.reconfigure`.

Time is compressed: the trace's arrival times by `--scale-rate` (a rate scale divides them), the controller's
windows, cooldowns and intervals (the CRD defaults) by `--time-scale`. Every flag in seconds is in replayed seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from overlap.bench.report import RequestRecord, RunResult, compute_metrics, markdown_table, text_table
from overlap.bench.traces import Trace, TraceError, truncate
from overlap.operator.control.policy import ScalingPolicy
from overlap.operator.control.signals import DEFAULT_WINDOW_S

RUNS = ("static-min", "static-max", "autoscale", "autoscale+tune")
DEFAULT_TRACE = "azure"
# The Azure hour replayed in ~58 s with prompts/outputs at 5% (mean ~58 prompt and ~11 output tokens): the peak
# minute then offers ~500 req/s, several times what one simulated replica serves.
AZURE_SCALE_RATE = 60.0
AZURE_SCALE_TOKENS = 0.05
DEFAULT_TIME_SCALE = 60.0  # the controller's CRD defaults (seconds) are divided by this
DEFAULT_SIM_COST = (5.0, 150.0)  # a step of N tokens: 5 ms + N x 150 us
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS = 1, 8
DEFAULT_COLD_START_S = 1.0  # a 60 s pod start (image pull, model load) at the default time scale
DEFAULT_SLO_S = 1.0  # P99 end-to-end latency objective, replayed seconds
DEFAULT_DRAIN_S = 10.0
QUICK_TRACE_S = 15.0
QUICK_DRAIN_S = 3.0
CRD_SCALING = ScalingPolicy()  # the CRD's autoscaling defaults (seconds in operator time)
# The operator's latency queries look at the last minute (its --signal-window-s default), divided by --time-scale.
SIGNAL_WINDOW_S = DEFAULT_WINDOW_S
# autoscale+tune: the tuner may move these knobs inside these bounds (a knob without bounds is never tuned).
TUNING_BOUNDS = {"max_num_seqs": (8, 128), "max_num_batched_tokens": (256, 4096), "num_buffers": (1, 3)}
_PROGRESS_EVERY_S = 5.0


@dataclass(slots=True)
class RunPlan:
    """One run of the comparison: the scaling mode, the first replica count, and whether tuning is on."""

    label: str
    mode: str  # builtin | off
    initial_replicas: int
    tune: bool


@dataclass(slots=True)
class Setup:
    """Everything every run shares."""

    trace: Trace
    cost_ms_us: tuple[float, float]
    min_replicas: int
    max_replicas: int
    max_num_seqs: int
    time_scale: float
    interval_s: float
    cold_start_s: float
    slo_s: float
    drain_s: float
    up_watermark: float = CRD_SCALING.up_watermark
    down_watermark: float = CRD_SCALING.down_watermark
    seed: int = 0
    progress: bool = True
    log: object = sys.stdout

    def scaling_policy(self, mode: str) -> ScalingPolicy:
        crd = CRD_SCALING
        k = self.time_scale
        return ScalingPolicy(
            mode=mode,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            up_watermark=self.up_watermark,
            down_watermark=self.down_watermark,
            up_window_s=crd.up_window_s / k,
            down_window_s=crd.down_window_s / k,
            up_cooldown_s=crd.up_cooldown_s / k,
            down_cooldown_s=crd.down_cooldown_s / k,
            interval_s=self.interval_s,
        )

    def policy(self, plan: RunPlan):
        from overlap.operator.control.policy import Policy, TuningPolicy

        tuning = TuningPolicy(
            enabled=plan.tune,
            interval_s=TuningPolicy().interval_s / self.time_scale,
            signal_window_s=SIGNAL_WINDOW_S / self.time_scale,
            bounds=TUNING_BOUNDS if plan.tune else {},
            p99_slo_s=self.slo_s,
        )
        return Policy(scaling=self.scaling_policy(plan.mode), tuning=tuning)

    def plans(self, names: list[str]) -> list[RunPlan]:
        table = {
            "static-min": RunPlan("static-min", "off", self.min_replicas, False),
            "static-max": RunPlan("static-max", "off", self.max_replicas, False),
            "autoscale": RunPlan("autoscale", "builtin", self.min_replicas, False),
            "autoscale+tune": RunPlan("autoscale+tune", "builtin", self.min_replicas, True),
        }
        return [table[name] for name in names]


# ---------------------------------------------------------------------------------------------------- replicas


class Replica:
    """One simulated pod: an Engine on an asynchronous SimRunner, stepped by its own thread. Times are seconds on
    the run's clock (`clock()`)."""

    def __init__(self, name: str, setup: Setup, knobs: dict, clock, ready_at: float, on_finished) -> None:
        from overlap.engine import Engine, EngineConfig
        from overlap.engine.model.sim_runner import CostModel, SimRunner

        fixed_ms, per_token_us = setup.cost_ms_us
        config = EngineConfig(**knobs)
        runner = SimRunner.from_config(config, CostModel(fixed_ms / 1000, per_token_us / 1e6), asynchronous=True)
        self.name = name
        self.engine = Engine(config, runner=runner)
        self.created = clock()
        self.ready_at = ready_at
        self.stopped: float | None = None  # when it went (drained, or cancelled while starting)
        self.draining = False
        self.num_submitted = 0  # written by the router thread only
        self.num_finished = 0  # written by this replica's thread only
        self._clock = clock
        self._busy_s_seen = 0.0
        self._on_finished = on_finished
        self._closing = False
        self._wakeup = threading.Event()
        self._thread = threading.Thread(target=self._drive, name=f"replica-{name}", daemon=True)
        self._thread.start()

    def is_ready(self, now: float) -> bool:
        return not self.draining and self.stopped is None and now >= self.ready_at

    @property
    def is_asked_for(self) -> bool:
        """Counted in the replica count the controller sees (ready or starting, not draining)."""
        return not self.draining and self.stopped is None

    @property
    def outstanding(self) -> int:
        return self.num_submitted - self.num_finished

    def submit(self, request_id: str, tokens: list[int], sampling, arrival_time: float) -> None:
        self.engine.add_request(request_id, tokens, sampling, arrival_time=arrival_time)
        self.num_submitted += 1
        self._wakeup.set()

    def busy_since_last(self) -> float:
        """Device-busy seconds since the previous call (what rate() over a busy-seconds counter gives)."""
        total = self.engine.runner.busy_s_total
        delta, self._busy_s_seen = total - self._busy_s_seen, total
        return delta

    def drain(self, now: float) -> None:
        """Stop receiving; the thread finishes what it holds, then the replica goes. One still starting holds
        nothing and goes now."""
        self.draining = True
        if now < self.ready_at:
            self.stopped = now
        self._wakeup.set()

    def _drive(self) -> None:
        engine = self.engine
        while not self._closing:
            if not engine.has_unfinished() and not engine.executor.num_in_flight:
                if self.draining:
                    break
                self._wakeup.wait(0.02)
                self._wakeup.clear()
                continue
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    self.num_finished += 1
                    self._on_finished(out)
            if not outputs and not engine.scheduler.running:
                time.sleep(0.0005)  # requests wait for KV blocks: do not spin
        if self.stopped is None and self.draining:
            self.stopped = self._clock()

    def lifetime(self, end: float) -> float:
        """Replica-seconds it cost up to `end`: from the scale-up (a starting pod already holds its node) until it
        went."""
        stopped = end if self.stopped is None else min(self.stopped, end)
        return max(0.0, stopped - self.created)

    def close(self) -> None:
        self._closing = True
        self._wakeup.set()
        self._thread.join(timeout=5)
        self.engine.close()


# ---------------------------------------------------------------------------------------------------- one run


@dataclass(slots=True)
class Tick:
    t: float
    arrival_rate: float  # requests submitted per second since the previous tick
    ready: int
    replicas: int  # asked for (ready + starting)
    queue_depth: float
    action: str


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


def prepare_requests(trace: Trace, seed: int, max_model_len: int = 2048) -> list[tuple[list[int], int]]:
    """(prompt ids, max tokens) per request, the same for every run."""
    from overlap.bench.replay import fit_to_context, prompt_token_ids

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
        self.knobs = {"max_num_seqs": setup.max_num_seqs, "max_num_batched_tokens": 2048, "num_buffers": 2}
        self.history = History(keep_s=900 / setup.time_scale)
        self.signal_window_s = SIGNAL_WINDOW_S / setup.time_scale
        self.records = [
            RequestRecord(f"r{i}", r.arrival_s, num_prompt_tokens=len(p[0]))
            for i, (r, p) in enumerate(zip(self.trace.requests, prepared, strict=True))
        ]
        self.recent: deque[tuple[float, float, float, float]] = deque()  # (finished, e2e, queued, ttft) per request
        self.fleet: list[Replica] = []
        self.run = ControlRun(RunResult(plan.label, "in-process", {}, self.records, 0.0, 0.0))
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
        self.recent.append((rec.finished, rec.finished - rec.arrived, queued, ttft))

    def add_replica(self, cold: bool) -> None:
        name = f"{self.plan.label}-{len(self.fleet)}"
        ready_at = self.clock() + (self.setup.cold_start_s if cold else 0.0)
        self.fleet.append(Replica(name, self.setup, self.knobs, self.clock, ready_at, self.on_finished))

    def route(self, i: int, now: float, sampling_cls, invalid_error) -> None:
        """Send request i to the ready replica with the fewest outstanding requests."""
        rec = self.records[i]
        ready = [r for r in self.fleet if r.is_ready(now)]
        if not ready:  # cannot happen with min_replicas >= 1 warm at the start; kept as a visible outcome
            rec.status, rec.detail = "rejected", "no ready replica"
            return
        target = min(ready, key=lambda r: r.outstanding)
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
        return Signals(
            time=now,
            ready_replicas=len(ready),
            queue_depth=float(sum(s["num_waiting"] for s in stats)) if ready else None,
            device_busy=float(np.mean(busy)) if busy else None,
            queue_time_share=sum(w[2] for w in window) / sum(e2e) if e2e and sum(e2e) > 0 else None,
            p99_latency_s=float(np.percentile(e2e, 99)) if e2e else None,
            ttft_p99_s=float(np.percentile([w[3] for w in window], 99)) if window else None,
            kv_cache_usage=max(s["kv_usage"] for s in stats) if stats else None,
        )

    def tick(self, now: float) -> None:
        """Read the signals, decide, carry the decision out, remember it."""
        from overlap.operator.control.policy import RETUNE, SCALE_DOWN, SCALE_UP, Current, decide

        signals = self.signals(now)
        asked = [r for r in self.fleet if r.is_asked_for]
        decision = decide(signals, Current(len(asked), dict(self.knobs)), self.history, self.policy)
        if decision.action == SCALE_UP:
            for _ in range(decision.replicas - len(asked)):
                self.add_replica(cold=True)
        elif decision.action == SCALE_DOWN:
            # cancel a replica still starting first (it holds nothing), else drain the least loaded ready one
            victims = sorted(asked, key=lambda r: (now >= r.ready_at, r.outstanding))
            for replica in victims[: len(asked) - decision.replicas]:
                replica.drain(now)
        elif decision.action == RETUNE:
            self.knobs = {k: int(decision.engine.get(k, v)) for k, v in self.knobs.items()}
            for replica in asked:
                replica.engine.reconfigure(**{k: self.knobs[k] for k in decision.changes})
        self.history.record(signals, decision)
        if decision.action != "hold":
            entry = {"t": round(now, 3), "action": decision.action, "replicas": decision.replicas}
            self.run.decisions.append({**entry, "reason": decision.reason})
            _say(
                self.setup,
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
        next_tick, next_progress = 0.0, _PROGRESS_EVERY_S
        submit_end: float | None = None
        cpu0 = time.process_time()
        self.start = time.monotonic()
        for replica in self.fleet:
            replica.created = replica.ready_at = 0.0
        while True:
            now = self.clock()
            while self.num_submitted < len(records) and trace.requests[self.num_submitted].arrival_s <= now:
                self.route(self.num_submitted, now, SamplingParams, InvalidRequestError)
                lags.append(now - trace.requests[self.num_submitted].arrival_s)
                self.num_submitted += 1
            if submit_end is None and self.num_submitted == len(records):
                submit_end = now
            if now >= next_tick:
                self.tick(now)
                next_tick = max(next_tick + interval, now)
            if now >= next_progress:
                next_progress += _PROGRESS_EVERY_S
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
        run.final_knobs = dict(self.knobs)
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
        _say(
            self.setup,
            f"  {self.plan.label} t={now:5.1f} s: submitted {self.num_submitted}/{len(self.records)}, finished {done}, "
            f"{ready} replicas ready of {asked}, {waiting:.0f} waiting",
        )


def run_control(setup: Setup, plan: RunPlan, prepared: list[tuple[list[int], int]]) -> ControlRun:
    """Replay the trace on a fleet driven by `decide()` (see the module docstring)."""
    return _Loop(setup, plan, prepared).replay()


def _say(setup: Setup, text: str) -> None:
    if setup.progress:
        print(text, file=setup.log, flush=True)


# ---------------------------------------------------------------------------------------------------- the report


def summarize_run(run: ControlRun, slo_s: float) -> dict:
    """One run's figures for the table and the JSON."""
    m = compute_metrics(run.result)
    records = run.result.records
    wall = run.result.wall_s
    within = sum(r.status == "finished" and r.e2e is not None and r.e2e <= slo_s for r in records)
    # SLO misses (late, unfinished or refused) per tick, counted at the tick that ends the interval they arrived in
    late = [r.arrived for r in records if not (r.status == "finished" and r.e2e is not None and r.e2e <= slo_s)]
    where = np.minimum(np.searchsorted([k.t for k in run.ticks], late), len(run.ticks) - 1)
    misses = np.bincount(where, minlength=len(run.ticks))
    counts = {
        action: sum(d["action"] == action for d in run.decisions) for action in ("scale-up", "scale-down", "retune")
    }
    return {
        "label": run.result.label,
        "requests": m.num_requests,
        "finished": m.num_finished,
        "unfinished": m.num_unfinished,
        "rejected": m.num_rejected + m.num_failed,
        "wall_s": round(wall, 2),
        "throughput_rps": round(m.requests_per_s, 1),
        "latency_mean_ms": _round(m.e2e_mean_ms),
        "latency_p50_ms": _round(m.e2e_p50_ms),
        "latency_p99_ms": _round(m.e2e_p99_ms),
        "ttft_p99_ms": _round(m.ttft_p99_ms),
        "slo_attainment": round(within / max(m.num_requests, 1), 4),
        "replica_seconds": round(run.replica_seconds, 2),
        "mean_replicas": round(run.replica_seconds / max(wall, 1e-9), 2),
        "scale_ups": counts["scale-up"],
        "scale_downs": counts["scale-down"],
        "retunes": counts["retune"],
        "knobs_final": run.final_knobs,
        "host": {
            "submit_lag_ms": {k: round(v, 1) for k, v in run.submit_lag_ms.items()},
            "cpu_share": round(run.cpu_share, 2),
        },
        "decisions": run.decisions,
        "timeline": [
            {
                "t": round(k.t, 3),
                "arrival_rps": round(k.arrival_rate, 1),
                "ready": k.ready,
                "replicas": k.replicas,
                "queue_depth": k.queue_depth,
                "action": k.action,
                "slo_misses": int(missed),
            }
            for k, missed in zip(run.ticks, misses, strict=True)
        ],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


_TABLE = (
    ("run", "label", None),
    ("done", "finished", "d"),
    ("unfin.", "unfinished", "d"),
    ("rej.", "rejected", "d"),
    ("req/s", "throughput_rps", ".1f"),
    ("mean ms", "latency_mean_ms", ".0f"),
    ("P50 ms", "latency_p50_ms", ".0f"),
    ("P99 ms", "latency_p99_ms", ".0f"),
    ("TTFT P99", "ttft_p99_ms", ".0f"),
    ("SLO", "slo_attainment", ".1%"),
    ("replicas", "mean_replicas", ".2f"),
    ("repl-s", "replica_seconds", ".1f"),
    ("ups", "scale_ups", "d"),
    ("downs", "scale_downs", "d"),
    ("retunes", "retunes", "d"),
)


def table(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [name for name, _, _ in _TABLE]
    rows = [
        [run[key] if fmt is None else ("-" if run[key] is None else format(run[key], fmt)) for _, key, fmt in _TABLE]
        for run in runs
    ]
    return header, rows


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Arrival rate, replicas and queue depth over time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7, 6), dpi=80, sharex=True)
    first = runs[0]["timeline"]
    axes[0].plot([k["t"] for k in first[1:]], [k["arrival_rps"] for k in first[1:]], color="black", lw=0.8)
    axes[0].set_ylabel("arrivals (req/s)")
    for run in runs:
        t = [k["t"] for k in run["timeline"]]
        axes[1].step(t, [k["replicas"] for k in run["timeline"]], where="post", label=run["label"], lw=1.2)
        axes[2].plot(t, [k["queue_depth"] for k in run["timeline"]], label=run["label"], lw=0.9)
    axes[1].set_ylabel("replicas (asked)")
    axes[2].set_ylabel("waiting requests")
    axes[2].set_yscale("symlog", linthresh=10)
    axes[2].set_xlabel("replayed time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_title(textwrap.fill(title, 110), fontsize=7)
    fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=len(runs), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- command


def add_parser(subparsers) -> None:
    from overlap.bench.replay import add_transform_arguments

    parser = subparsers.add_parser(
        "control",
        help="replay a trace against simulated replicas driven by the operator's control loop (scaling, tuning)",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"azure defaults: --scale-rate {AZURE_SCALE_RATE:g} --scale-tokens {AZURE_SCALE_TOKENS:g} "
        "(other traces: 1 and 1). Runs: static-min and static-max hold min/max replicas; autoscale uses the "
        "builtin queue watermark; "
        f"autoscale+tune also retunes {', '.join(TUNING_BOUNDS)} within {TUNING_BOUNDS} against --slo-s.",
    )
    parser.add_argument(
        "--trace", default=DEFAULT_TRACE, help="azure | steady | bursty | bursty_2x | a .jsonl/.csv file"
    )
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=DEFAULT_MIN_REPLICAS,
        help="static-min's fleet, autoscaling's floor and start",
    )
    parser.add_argument(
        "--max-replicas", type=int, default=DEFAULT_MAX_REPLICAS, help="static-max's fleet, autoscaling's ceiling"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        help="divide the controller's CRD-default windows, cooldowns and intervals by this (default %(default)g)",
    )
    parser.add_argument(
        "--interval-s", type=float, help="controller tick, replayed seconds (default: the CRD's 15 s / --time-scale)"
    )
    parser.add_argument(
        "--cold-start-s",
        type=float,
        default=DEFAULT_COLD_START_S,
        help="seconds before a new replica serves (default %(default)g)",
    )
    parser.add_argument(
        "--up-watermark",
        type=float,
        default=CRD_SCALING.up_watermark,
        help="waiting requests per ready replica to scale up (CRD default %(default)g)",
    )
    parser.add_argument(
        "--down-watermark",
        type=float,
        default=CRD_SCALING.down_watermark,
        help="waiting per ready replica to scale down (CRD default %(default)g)",
    )
    parser.add_argument(
        "--slo-s", type=float, default=DEFAULT_SLO_S, help="P99 latency SLO (tuning, attainment; default %(default)g)"
    )
    parser.add_argument(
        "--sim-cost",
        metavar="FIXED_MS,PER_TOKEN_US",
        help="a step of N tokens takes FIXED_MS + N x PER_TOKEN_US "
        f"(default {DEFAULT_SIM_COST[0]:g},{DEFAULT_SIM_COST[1]:g})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help="each engine's starting sequence cap (default %(default)d)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        help=f"longest wait after the last arrival (default {DEFAULT_DRAIN_S:g}, quick {QUICK_DRAIN_S:g})",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"replay only the first {QUICK_TRACE_S:g} s of the scaled trace"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for prompt token ids")
    parser.add_argument("--json", action="store_true", help="print the report JSON on stdout (the rest on stderr)")
    parser.add_argument("--out", help="report folder (default reports/control-<UTC time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    add_transform_arguments(parser)
    parser.set_defaults(func=_run, scale_rate=None, scale_tokens=None)


def setup_from_args(args: argparse.Namespace, log=sys.stdout) -> tuple[Setup, list[str]]:
    """Check the arguments (TraceError with one line for anything wrong) and build the shared setup."""
    from overlap.bench.replay import _parse_sim_cost, load_for_args

    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        raise TraceError(f"--runs: unknown run {', '.join(unknown) or '(none given)'}; choose from {', '.join(RUNS)}")
    if args.min_replicas < 1 or args.max_replicas < args.min_replicas:
        raise TraceError(f"need 1 <= --min-replicas <= --max-replicas, got {args.min_replicas} and {args.max_replicas}")
    for flag in ("time_scale", "slo_s", "up_watermark", "max_num_seqs"):
        if not getattr(args, flag) > 0:
            raise TraceError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    for flag in ("cold_start_s", "down_watermark"):
        if not getattr(args, flag) >= 0:
            raise TraceError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.interval_s is not None and not args.interval_s > 0:
        raise TraceError(f"--interval-s must be > 0, got {args.interval_s}")
    if args.drain_s is not None and not args.drain_s >= 0:
        raise TraceError(f"--drain-s must be >= 0, got {args.drain_s}")
    azure = args.trace == "azure"
    trace_args = argparse.Namespace(**vars(args))
    if trace_args.scale_rate is None:
        trace_args.scale_rate = AZURE_SCALE_RATE if azure else 1.0
    if trace_args.scale_tokens is None:
        trace_args.scale_tokens = AZURE_SCALE_TOKENS if azure else 1.0
    trace_args.quick = False  # this command's own quick length below
    trace = load_for_args(trace_args)
    if args.quick:
        trace = truncate(trace, duration_s=QUICK_TRACE_S)
    setup = Setup(
        trace=trace,
        cost_ms_us=_parse_sim_cost(args.sim_cost) or DEFAULT_SIM_COST,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        max_num_seqs=args.max_num_seqs,
        time_scale=args.time_scale,
        interval_s=args.interval_s or CRD_SCALING.interval_s / args.time_scale,
        cold_start_s=args.cold_start_s,
        slo_s=args.slo_s,
        drain_s=args.drain_s if args.drain_s is not None else (QUICK_DRAIN_S if args.quick else DEFAULT_DRAIN_S),
        up_watermark=args.up_watermark,
        down_watermark=args.down_watermark,
        seed=args.seed,
        progress=not args.no_progress,
        log=log,
    )
    return setup, names


def replica_capacity_rps(setup: Setup) -> float:
    """What one replica serves at most of this trace at its starting sequence cap B: with B sequences decoding,
    a step of fixed + per_token x tokens, and each request's prompt + output tokens passing through once, throughput
    is B / (O x fixed + B x per_token x (P + O)) for mean prompt P and output O tokens."""
    fixed_s, per_token_s = setup.cost_ms_us[0] / 1000, setup.cost_ms_us[1] / 1e6
    prompts = [r.prompt_tokens or 1 for r in setup.trace.requests]
    outputs = [r.max_tokens for r in setup.trace.requests]
    p, o, b = float(np.mean(prompts)), float(np.mean(outputs)), setup.max_num_seqs
    return b / (o * fixed_s + b * per_token_s * (p + o))


def peak_rate_rps(trace: Trace, bin_s: float) -> float:
    arrivals = [r.arrival_s for r in trace.requests]
    counts, _ = np.histogram(
        arrivals,
        bins=max(1, math.ceil((trace.duration_s + 1e-9) / bin_s)),
        range=(0, max(bin_s, math.ceil((trace.duration_s + 1e-9) / bin_s) * bin_s)),
    )
    return float(counts.max() / bin_s)


def header_lines(setup: Setup) -> list[str]:
    policy = setup.scaling_policy("builtin")
    k = setup.time_scale
    capacity = replica_capacity_rps(setup)
    peak = peak_rate_rps(setup.trace, SIGNAL_WINDOW_S / k)
    return [
        f"trace {setup.trace.describe()}",
        f"simulated device: a step of N tokens takes {setup.cost_ms_us[0]:g} ms + N x {setup.cost_ms_us[1]:g} us; "
        f"one replica at max_num_seqs {setup.max_num_seqs} serves at most ~{capacity:.0f} req/s of this trace; "
        f"the trace peaks at {peak:.0f} req/s (over {SIGNAL_WINDOW_S / k:g} s) = {peak / capacity:.1f} replicas",
        f"controller time / {k:g}: tick {setup.interval_s:g} s, up window {policy.up_window_s:g} s, down window "
        f"{policy.down_window_s:g} s, cooldowns up {policy.up_cooldown_s:g} s / down {policy.down_cooldown_s:g} s, "
        f"latency signals over {SIGNAL_WINDOW_S / k:g} s; cold start {setup.cold_start_s:g} s; watermarks "
        f"{setup.up_watermark:g} up / {setup.down_watermark:g} down waiting per ready replica; replicas "
        f"{setup.min_replicas}..{setup.max_replicas}; P99 SLO {setup.slo_s:g} s; router: least outstanding requests",
    ]


def compare(setup: Setup, names: list[str]) -> dict:
    """Run each plan on the same trace; the report as a JSON-able dict."""
    prepared = prepare_requests(setup.trace, setup.seed)
    runs = []
    for plan in setup.plans(names):
        _say(
            setup,
            f"run {plan.label}: {plan.initial_replicas} replicas, scaling {plan.mode}, "
            f"tuning {'on' if plan.tune else 'off'}",
        )
        run = run_control(setup, plan, prepared)
        summary = summarize_run(run, setup.slo_s)
        runs.append(summary)
        _say(
            setup,
            f"run {plan.label}: {summary['finished']}/{summary['requests']} finished in {summary['wall_s']:.1f} s, "
            f"{summary['unfinished']} unfinished, {summary['rejected']} rejected; router lag P99 "
            f"{summary['host']['submit_lag_ms']['p99']:.1f} ms, process CPU {summary['host']['cpu_share']:.2f} cores",
        )
    return {
        "trace": setup.trace.describe(),
        "header": header_lines(setup),
        "setup": {
            "sim_cost": {"fixed_ms": setup.cost_ms_us[0], "per_token_us": setup.cost_ms_us[1]},
            "replica_capacity_rps": round(replica_capacity_rps(setup), 1),
            "time_scale": setup.time_scale,
            "interval_s": setup.interval_s,
            "cold_start_s": setup.cold_start_s,
            "slo_s": setup.slo_s,
            "drain_s": setup.drain_s,
            "scaling": dataclasses.asdict(setup.scaling_policy("builtin")),
            "tuning_bounds": TUNING_BOUNDS,
            "router": "least outstanding requests over ready replicas",
        },
        "runs": runs,
    }


def _run(args: argparse.Namespace) -> int:
    log = sys.stderr if args.json else sys.stdout
    setup, names = setup_from_args(args, log)
    out_dir = Path(args.out or f"reports/control-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TraceError(f"--out {out_dir}: {exc.strerror}") from None
    for line in header_lines(setup):
        print(line, file=log)
    started = time.monotonic()
    report = compare(setup, names)
    report["wall_s"] = round(time.monotonic() - started, 1)
    header, rows = table(report["runs"])
    plot(report["runs"], out_dir / "control.png", setup.trace.describe())
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(
        "\n".join(
            [
                "# Closed-loop replay",
                "",
                *report["header"],
                "",
                markdown_table(header, rows),
                "",
                "![control](control.png)",
                "",
            ]
        )
    )
    print("\n" + text_table(header, rows), file=log)
    print(f"report: {out_dir}/report.md, plot {out_dir}/control.png (wall {report['wall_s']:.1f} s)", file=log)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
