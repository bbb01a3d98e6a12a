"""The control loop's policy: a pure function from load signals to a decision (no Kubernetes, no Prometheus).

`decide(signals, current, history, policy) -> Decision` is called once per tick for each InferenceService. The
operator's timer (overlap.operator.control.loop) reads the signals from Prometheus and carries the decision out; the
closed-loop trace replay (`overlap bench control`) calls the same function on simulated replicas.

Replicas follow a queue watermark: waiting requests per ready replica must stay above
`queueWatermarkPerReplica` for a whole scale-up window (below `scaleDownWatermark` for a whole scale-down window)
before anything moves, and cooldowns space the moves out. Scaling up is proportional (like the HPA's
`ceil(replicas x load / target)`), scaling down goes one replica at a time, since an idle replica costs less than
a cold start under the next burst.

Nothing moves while replicas are still starting (spec asks for more than are ready): a backlog built during a
cold start does not shrink in proportion to the replicas on their way, so scaling again on it overshoots.

Engine knobs follow what the device is doing, one knob per decision so that the next tick measures its effect.
Readings are averaged over the last tuning interval, and the table's thresholds leave a dead band between
"mostly queueing" and "mostly execution":

| reading (interval average) | what it means | move |
|---|---|---|
| KV cache almost full | sequences get preempted and recomputed | max_num_seqs / 2 |
| latency over the SLO, > 60% of it queueing | too little concurrency | max_num_seqs x 2 |
| latency over the SLO, < 30% of it queueing | steps too large | max_num_seqs / 2, then max_num_batched_tokens / 2 |
| device often idle while requests queue | the host cannot feed the device | num_buffers + 1, then max_num_seqs x 2 |

Every move stays inside `tuning.bounds`; a knob without bounds is never tuned. After any move (its own or a
scale) the tuner waits a whole interval and at least the latency signals' window (the PromQL's one minute), so
it judges the move on readings taken after it; it does not undo its own last move of a knob within three such
waits.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# Thresholds of the tuning table above (shares and ratios, 0..1).
KV_PRESSURE = 0.90  # KV usage above this: preemptions are near
QUEUEING_SHARE = 0.6  # queue time above this share of end-to-end latency: latency is mostly waiting
EXECUTION_SHARE = 0.3  # queue time below this share: latency is mostly execution (in between: hold)
UNDO_AFTER_INTERVALS = 3  # a knob's last move may be reversed only after this many tuning intervals
DEVICE_IDLE = 0.70  # device busy below this while requests wait: the host is the bottleneck

HOLD, SCALE_UP, SCALE_DOWN, RETUNE = "hold", "scale-up", "scale-down", "retune"


@dataclass(frozen=True, slots=True)
class Signals:
    """One reading of a service's load; None marks a signal Prometheus did not have."""

    time: float  # seconds; only differences matter (the operator uses the epoch)
    ready_replicas: int
    queue_depth: float | None = None  # requests waiting in the engines, summed over the service's pods
    device_busy: float | None = None  # mean device-busy ratio over the pods
    queue_time_share: float | None = None  # queue time / end-to-end latency over the last minute
    p99_latency_s: float | None = None
    ttft_p99_s: float | None = None
    kv_cache_usage: float | None = None  # the fullest pod's KV usage

    def waiting_per_replica(self) -> float | None:
        if self.queue_depth is None or self.ready_replicas <= 0:
            return None
        return self.queue_depth / self.ready_replicas


@dataclass(frozen=True, slots=True)
class Current:
    """What runs now: the replica count asked for and the engines' live knobs (snake_case, EngineConfig names)."""

    replicas: int
    engine: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """spec.autoscaling; mode is builtin (decide moves replicas), external or off (it never does)."""

    mode: str = "off"
    min_replicas: int = 1
    max_replicas: int = 4
    up_watermark: float = 32
    down_watermark: float = 4
    up_window_s: float = 30
    down_window_s: float = 300
    up_cooldown_s: float = 60
    down_cooldown_s: float = 300
    interval_s: float = 15
    # How long the loop waits for replicas to become ready before it stops holding for them (a GPU pod Pending
    # for want of a node, a crash loop): it then scales on the ready ones, and can remove the stuck ones.
    startup_deadline_s: float = 600


@dataclass(frozen=True, slots=True)
class TuningPolicy:
    """spec.tuning; bounds maps a knob (snake_case) to its (min, max)."""

    enabled: bool = False
    interval_s: float = 30
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # How far back the latency signals look (the operator's PromQL rate window): after a move the tuner waits at
    # least this long, or it would judge the move on readings taken before it.
    signal_window_s: float = 60
    p99_slo_s: float | None = None
    ttft_slo_s: float | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    scaling: ScalingPolicy = ScalingPolicy()
    tuning: TuningPolicy = TuningPolicy()

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], signal_window_s: float = 60) -> Policy:
        """The policy of an InferenceService spec (with the CRD's defaults filled in: spec.with_defaults) for an
        operator whose latency signals look back `signal_window_s`."""
        from overlap.operator.spec import ENGINE_FIELDS, TUNABLE_KNOBS

        auto = spec["autoscaling"]
        scaling = ScalingPolicy(
            mode=auto["mode"],
            min_replicas=auto["minReplicas"],
            max_replicas=auto["maxReplicas"],
            up_watermark=auto["queueWatermarkPerReplica"],
            down_watermark=auto["scaleDownWatermark"],
            up_window_s=auto["scaleUpWindowSeconds"],
            down_window_s=auto["scaleDownWindowSeconds"],
            up_cooldown_s=auto["scaleUpCooldownSeconds"],
            down_cooldown_s=auto["scaleDownCooldownSeconds"],
            interval_s=auto["intervalSeconds"],
            startup_deadline_s=auto["startupDeadlineSeconds"],
        )
        tuning = spec["tuning"]
        bounds = tuning.get("bounds") or {}
        slo = tuning.get("latencySLO") or {}
        return cls(
            scaling=scaling,
            tuning=TuningPolicy(
                enabled=tuning["enabled"],
                interval_s=tuning["intervalSeconds"],
                bounds={ENGINE_FIELDS[k]: (bounds[k]["min"], bounds[k]["max"]) for k in TUNABLE_KNOBS if k in bounds},
                p99_slo_s=slo.get("p99Seconds"),
                ttft_slo_s=slo.get("ttftP99Seconds"),
                signal_window_s=signal_window_s,
            ),
        )

    def interval_s(self) -> float:
        """How often the loop should tick: the faster of the two loops that are on (None of them: never)."""
        intervals = [self.scaling.interval_s] if self.scaling.mode == "builtin" else []
        intervals += [self.tuning.interval_s] if self.tuning.enabled else []
        return min(intervals) if intervals else math.inf


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # hold, scale-up, scale-down or retune
    reason: str
    replicas: int  # the replica count to run (unchanged unless scaling)
    engine: Mapping[str, float]  # the live knobs to run (unchanged unless retuning)
    changes: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # knob -> (old, new) when retuning

    def to_status(self, when: str) -> dict[str, Any]:
        """The CRD's status.lastDecision."""
        return {
            "time": when,
            "action": self.action,
            "reason": self.reason,
            "replicas": self.replicas,
            "engine": dict(self.engine),
        }


class History:
    """What the loop remembers between ticks: recent signals and when it last acted (kept by the caller)."""

    def __init__(self, keep_s: float = 3600.0) -> None:
        self.keep_s = keep_s
        self.samples: deque[Signals] = deque()
        self.last_scale_up: float | None = None
        self.last_scale_down: float | None = None
        self.last_retune: float | None = None
        self.last_moves: dict[str, tuple[float, int]] = {}  # knob -> (time, +1 up / -1 down) of its last retune

    def record(self, signals: Signals, decision: Decision) -> None:
        """Remember this tick's reading and the decision taken on it (call after carrying it out)."""
        self.samples.append(signals)
        while self.samples and signals.time - self.samples[0].time > self.keep_s:
            self.samples.popleft()
        if decision.action == SCALE_UP:
            self.last_scale_up = signals.time
        elif decision.action == SCALE_DOWN:
            self.last_scale_down = signals.time
        elif decision.action == RETUNE:
            self.last_retune = signals.time
            for knob, (old, new) in decision.changes.items():
                self.last_moves[knob] = (signals.time, 1 if new > old else -1)

    def last_scale(self) -> float | None:
        """When the loop last moved the replica count."""
        return max((t for t in (self.last_scale_up, self.last_scale_down) if t is not None), default=None)

    def last_move(self) -> float | None:
        """When the loop last moved anything (replicas or knobs)."""
        return max((t for t in (self.last_scale(), self.last_retune) if t is not None), default=None)

    def window(self, now: float, seconds: float) -> list[Signals]:
        """The samples of the last `seconds` before `now`."""
        return [s for s in self.samples if now - s.time <= seconds]

    def covers(self, now: float, seconds: float) -> bool:
        """True when the samples reach back at least `seconds` (a window needs a full span of readings)."""
        return bool(self.samples) and now - self.samples[0].time >= seconds


def decide(signals: Signals, current: Current, history: History, policy: Policy) -> Decision:
    """This tick's decision. Scaling comes first: a retune measured across a replica change would mislead."""
    pending = current.replicas - signals.ready_replicas
    stuck = None
    if pending > 0 and signals.queue_depth is not None and _in_bounds(current, policy.scaling):
        # Pending since the last scale move, or since the loop's first reading if it never moved.
        since = history.last_scale()
        if since is None:
            since = history.samples[0].time if history.samples else signals.time
        waited = signals.time - since
        if waited < policy.scaling.startup_deadline_s:
            reason = f"{pending} of {current.replicas} replicas still starting; waiting for them before the next move"
            return Decision(HOLD, reason, current.replicas, dict(current.engine))
        stuck = (
            f"{pending} of {current.replicas} replicas not ready {waited:.0f} s after the last scale "
            f"(start-up deadline {policy.scaling.startup_deadline_s:g} s): scaling on the ready ones"
        )
    scaled = _scale(signals, current, history, policy.scaling)
    if scaled is not None:
        return scaled
    if policy.tuning.enabled and stuck is None:  # a retune measured on a fleet with stuck replicas would mislead
        tuned = _tune(signals, current, history, policy.tuning)
        if tuned is not None:
            return tuned
    return Decision(HOLD, stuck or _hold_reason(signals, policy), current.replicas, dict(current.engine))


def _in_bounds(current: Current, policy: ScalingPolicy) -> bool:
    return policy.mode != "builtin" or policy.min_replicas <= current.replicas <= policy.max_replicas


def _since(then: float | None, now: float) -> float:
    return math.inf if then is None else now - then


def _all_above(samples: Iterable[Signals], threshold: float) -> bool:
    values = [s.waiting_per_replica() for s in samples]
    return bool(values) and all(v is not None and v > threshold for v in values)


def _all_below(samples: Iterable[Signals], threshold: float) -> bool:
    values = [s.waiting_per_replica() for s in samples]
    return bool(values) and all(v is not None and v < threshold for v in values)


def _scale(signals: Signals, current: Current, history: History, policy: ScalingPolicy) -> Decision | None:
    if policy.mode != "builtin":
        return None
    engine = dict(current.engine)
    low, high = policy.min_replicas, policy.max_replicas
    if not low <= current.replicas <= high:
        target = min(max(current.replicas, low), high)
        action = SCALE_UP if target > current.replicas else SCALE_DOWN
        return Decision(action, f"replicas {current.replicas} outside {low}..{high}", target, engine)
    per_replica = signals.waiting_per_replica()
    if per_replica is None:
        return None
    now = signals.time
    # The window is this reading plus the history's readings inside it, and it must span the whole window.
    up_window = [*history.window(now, policy.up_window_s), signals]
    if (
        per_replica > policy.up_watermark
        and current.replicas < high
        and (policy.up_window_s == 0 or history.covers(now, policy.up_window_s))
        and _all_above(up_window, policy.up_watermark)
        and _since(history.last_scale_up, now) >= policy.up_cooldown_s
    ):
        wanted = math.ceil(signals.ready_replicas * per_replica / policy.up_watermark)
        target = min(high, max(current.replicas + 1, wanted))
        reason = (
            f"{per_replica:.1f} waiting per ready replica > watermark {policy.up_watermark:g} "
            f"for {policy.up_window_s:g} s"
        )
        return Decision(SCALE_UP, reason, target, engine)
    down_window = [*history.window(now, policy.down_window_s), signals]
    if (
        per_replica < policy.down_watermark
        and current.replicas > low
        and (policy.down_window_s == 0 or history.covers(now, policy.down_window_s))
        and _all_below(down_window, policy.down_watermark)
        and _since(history.last_scale(), now) >= policy.down_cooldown_s
    ):
        reason = (
            f"{per_replica:.1f} waiting per ready replica < {policy.down_watermark:g} for {policy.down_window_s:g} s"
        )
        return Decision(SCALE_DOWN, reason, current.replicas - 1, engine)
    return None


def _tune(signals: Signals, current: Current, history: History, policy: TuningPolicy) -> Decision | None:
    now = signals.time
    settle_s = max(policy.interval_s, policy.signal_window_s)
    if _since(history.last_move(), now) < settle_s:
        return None  # the last move's effect is not in the readings yet
    engine = dict(current.engine)
    signals = _averaged([*history.window(now, policy.interval_s), signals])

    def move(knob: str, factor: float, step: int = 0) -> dict[str, float] | None:
        """The engine with `knob` scaled by `factor` (or stepped by `step`) inside its bounds; None if it can't move."""
        if knob not in policy.bounds or knob not in engine:
            return None
        lo, hi = policy.bounds[knob]
        old = engine[knob]
        new = old + step if step else round(old * factor)
        new = int(min(max(new, lo), hi))
        if new == old:
            return None
        return {**engine, knob: new}

    def undoes(knob: str, moved: dict[str, float]) -> bool:
        """Would this reverse the knob's own last move, made less than UNDO_AFTER_INTERVALS intervals ago?"""
        when, direction = history.last_moves.get(knob, (None, 0))
        recent = _since(when, now) < UNDO_AFTER_INTERVALS * settle_s
        return recent and (moved[knob] - engine[knob]) * direction < 0

    def retune(candidates: list[tuple[str, float, int]], why: str) -> Decision | None:
        for knob, factor, step in candidates:
            moved = move(knob, factor, step)
            if moved is not None and not undoes(knob, moved):
                changes = {knob: (engine[knob], moved[knob])}
                text = f"{why}: {knob} {engine[knob]:g} -> {moved[knob]:g}"
                return Decision(RETUNE, text, current.replicas, moved, changes)
        return None

    kv, busy, share = signals.kv_cache_usage, signals.device_busy, signals.queue_time_share
    if kv is not None and kv > KV_PRESSURE:
        return retune([("max_num_seqs", 0.5, 0)], f"KV cache {kv:.0%} full (> {KV_PRESSURE:.0%})")
    over = _over_slo(signals, policy)
    if over is not None:
        if share is not None and share > QUEUEING_SHARE:
            return retune([("max_num_seqs", 2, 0)], f"{over}, {share:.0%} of it queueing")
        if share is not None and share < EXECUTION_SHARE:
            candidates = [("max_num_seqs", 0.5, 0), ("max_num_batched_tokens", 0.5, 0)]
            return retune(candidates, f"{over}, {1 - share:.0%} of it execution")
    waiting = signals.queue_depth is not None and signals.queue_depth > 0
    if busy is not None and busy < DEVICE_IDLE and waiting:
        candidates = [("num_buffers", 1, 1), ("max_num_seqs", 2, 0)]
        return retune(candidates, f"device busy {busy:.0%} (< {DEVICE_IDLE:.0%}) while requests wait")
    return None


def _averaged(samples: list[Signals]) -> Signals:
    """The last sample with each signal replaced by its mean over `samples` (missing readings left out)."""

    def mean(name: str) -> float | None:
        values = [v for s in samples if (v := getattr(s, name)) is not None]
        return sum(values) / len(values) if values else None

    names = ("queue_depth", "device_busy", "queue_time_share", "p99_latency_s", "ttft_p99_s", "kv_cache_usage")
    return replace(samples[-1], **{name: mean(name) for name in names})


def _over_slo(signals: Signals, policy: TuningPolicy) -> str | None:
    if policy.p99_slo_s is not None and signals.p99_latency_s is not None and signals.p99_latency_s > policy.p99_slo_s:
        return f"P99 {signals.p99_latency_s:.2f} s > SLO {policy.p99_slo_s:g} s"
    if policy.ttft_slo_s is not None and signals.ttft_p99_s is not None and signals.ttft_p99_s > policy.ttft_slo_s:
        return f"TTFT P99 {signals.ttft_p99_s:.2f} s > SLO {policy.ttft_slo_s:g} s"
    return None


def _hold_reason(signals: Signals, policy: Policy) -> str:
    per_replica = signals.waiting_per_replica()
    if per_replica is None:
        return "no queue signal (no ready replica, or Prometheus has no series yet)"
    return f"{per_replica:.1f} waiting per ready replica; within watermarks, nothing to retune"
