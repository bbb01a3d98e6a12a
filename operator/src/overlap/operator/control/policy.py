"""What the control loop's policy reads, remembers and returns (no Kubernetes, no Prometheus): a tick's load
`Signals`, what runs now (`Current`), the service's `Policy` (its scaling and tuning sections, with the CRD's
defaults), the `Decision`, and the `History` the loop keeps between ticks. The rules that turn them into a decision
are in overlap.operator.control.decide (replicas) and overlap.operator.control.tuning (engine knobs).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from overlap.engine.config import LiveKnobs, camel_case
from overlap.operator.control.forecast import BurstMemory, CapacityProfile, ColdStart, RateForecast
from overlap.operator.spec import DEFAULTS, SCALING_MODES, TUNABLE_KNOBS

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
    arrival_rate: float | None = None  # requests/s arriving at the sidecars
    finish_rate: float | None = None  # requests/s finished (stop or length)
    running: float | None = None  # sequences in the running batches, summed over the pods
    batch_size: float | None = None  # mean sequences per engine step over its recent steps, averaged over the pods
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None  # inter-token latency P90: the time per output token users see
    scraped_replicas: int | None = None  # pods whose last scrape succeeded (None: not asked, take the ready ones)
    activator_queue: float | None = None  # requests the activator holds while the service has no ready pod
    stale: tuple[str, ...] = ()  # signals whose query failed this tick (the reading holds their last value: none)

    def seen_replicas(self) -> int:
        """The replicas the per-replica figures are over: the ones Prometheus scraped, if it says."""
        if self.scraped_replicas is None:
            return self.ready_replicas
        return min(self.scraped_replicas, self.ready_replicas)

    def waiting_per_replica(self) -> float | None:
        replicas = self.seen_replicas()
        if replicas <= 0:
            return None
        if self.queue_depth is None:
            # no series at all on idle pods that did get scraped: nothing arrives, nothing waits
            return 0.0 if self.arrival_rate == 0 else None
        return self.queue_depth / replicas


@dataclass(frozen=True, slots=True)
class Current:
    """What runs now: the replica count asked for and the engines' live knobs."""

    replicas: int
    engine: LiveKnobs


# The policies' defaults are the CRD's (spec.DEFAULTS, which tests/operator checks against crds/): a service that
# leaves a field out and a policy built without it behave alike.
_AUTO, _TUNING = DEFAULTS["autoscaling"], DEFAULTS["tuning"]
_PREDICTIVE = _AUTO["predictive"]


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """spec.autoscaling; mode is builtin (decide moves replicas), advise (decide computes the same moves, the loop
    only reports them), external or off (it never does)."""

    mode: str = _AUTO["mode"]
    min_replicas: int = _AUTO["minReplicas"]
    max_replicas: int = _AUTO["maxReplicas"]
    up_watermark: float = _AUTO["queueWatermarkPerReplica"]
    down_watermark: float = _AUTO["scaleDownWatermark"]
    up_window_s: float = _AUTO["scaleUpWindowSeconds"]
    down_window_s: float = _AUTO["scaleDownWindowSeconds"]
    up_cooldown_s: float = _AUTO["scaleUpCooldownSeconds"]
    down_cooldown_s: float = _AUTO["scaleDownCooldownSeconds"]  # after a scale-up, before any scale-in
    interval_s: float = _AUTO["intervalSeconds"]
    # How long the loop waits for replicas to become ready before it stops holding for them (a GPU pod Pending
    # for want of a node, a crash loop): it then scales on the ready ones, and can remove the stuck ones.
    startup_deadline_s: float = _AUTO["startupDeadlineSeconds"]
    # SLO law (autoscaling.slo): P90 TTFT and P90 time per output token objectives; None: not scaled on.
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    # Predictive floor (autoscaling.predictive): replicas for the forecast arrival rate at this utilisation.
    predictive: bool = _PREDICTIVE["enabled"]
    target_utilization: float = _PREDICTIVE["targetUtilization"]
    cold_start_s: float = _PREDICTIVE["coldStartSeconds"]  # the start-up time assumed until one has been observed
    period_s: float = _PREDICTIVE["periodSeconds"]  # the daily profile's period
    # requests/s per replica measured offline, per max_num_seqs, until the loop measures its own at that limit
    capacity_hints: Mapping[int, float] = field(default_factory=dict)
    idle_timeout_s: float = _AUTO["idleTimeoutSeconds"]  # with min_replicas 0: no arrivals for this long scales to zero

    @property
    def scales(self) -> bool:
        """decide() computes replica moves (builtin applies them, advise only reports them)."""
        return self.mode in SCALING_MODES


@dataclass(frozen=True, slots=True)
class TuningPolicy:
    """spec.tuning; bounds maps a knob (a LiveKnobs field) to its (min, max)."""

    enabled: bool = _TUNING["enabled"]
    interval_s: float = _TUNING["intervalSeconds"]
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # How far back the latency signals look (the operator's PromQL rate window): after a move the tuner waits at
    # least this long, or it would judge the move on readings taken before it.
    signal_window_s: float = 60
    p99_slo_s: float | None = None
    ttft_slo_s: float | None = None

    @property
    def settle_s(self) -> float:
        """How long after any move the tuner waits: a whole interval and at least the signal window."""
        return max(self.interval_s, self.signal_window_s)


@dataclass(frozen=True, slots=True)
class Policy:
    scaling: ScalingPolicy = ScalingPolicy()
    tuning: TuningPolicy = TuningPolicy()

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], signal_window_s: float = 60) -> Policy:
        """The policy of an InferenceService spec (with the CRD's defaults filled in: spec.with_defaults) for an
        operator whose latency signals look back `signal_window_s`."""
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
            ttft_slo_s=(auto.get("slo") or {}).get("ttftSeconds"),
            tpot_slo_s=(auto.get("slo") or {}).get("tpotSeconds"),
            predictive=auto["predictive"]["enabled"],
            target_utilization=auto["predictive"]["targetUtilization"],
            cold_start_s=auto["predictive"]["coldStartSeconds"],
            period_s=auto["predictive"]["periodSeconds"],
            capacity_hints=_capacity_hints(auto["predictive"], spec["engine"]["maxNumSeqs"]),
            idle_timeout_s=auto["idleTimeoutSeconds"],
        )
        tuning = spec["tuning"]
        bounds = tuning.get("bounds") or {}
        slo = tuning.get("latencySLO") or {}
        return cls(
            scaling=scaling,
            tuning=TuningPolicy(
                enabled=tuning["enabled"],
                interval_s=tuning["intervalSeconds"],
                bounds={
                    k: (bounds[c]["min"], bounds[c]["max"]) for k in TUNABLE_KNOBS if (c := camel_case(k)) in bounds
                },
                p99_slo_s=slo.get("p99Seconds"),
                ttft_slo_s=slo.get("ttftP99Seconds"),
                signal_window_s=signal_window_s,
            ),
        )

    def interval_s(self) -> float:
        """How often the loop should tick: the faster of the two loops that are on (None of them: never)."""
        intervals = [self.scaling.interval_s] if self.scaling.scales else []
        intervals += [self.tuning.interval_s] if self.tuning.enabled else []
        return min(intervals) if intervals else math.inf


def _capacity_hints(predictive: Mapping[str, Any], start_max_num_seqs: int) -> dict[int, float]:
    """max_num_seqs -> offline requests/s per replica: capacityProfile's entries, and capacityPerReplica at the
    engine's start limit."""
    hints = {int(e["maxNumSeqs"]): float(e["requestsPerSecond"]) for e in predictive.get("capacityProfile") or ()}
    if predictive.get("capacityPerReplica") is not None:
        hints[int(start_max_num_seqs)] = float(predictive["capacityPerReplica"])
    return hints


@dataclass(frozen=True, slots=True)
class Decision:
    action: str  # hold, scale-up, scale-down or retune
    reason: str
    replicas: int  # the replica count to run (unchanged unless scaling)
    engine: LiveKnobs  # the live knobs to run (unchanged unless retuning)
    changes: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # knob -> (old, new) when retuning
    floor: int | None = None  # the predictive floor this tick (replicas), when it had a forecast and a capacity
    load: float | None = None  # the forecast load in replicas at the target utilisation (the floor unrounded)

    def to_status(self, when: str) -> dict[str, Any]:
        """The CRD's status.lastDecision."""
        return {
            "time": when,
            "action": self.action,
            "reason": self.reason,
            "replicas": self.replicas,
            "engine": self.engine.to_camel(),
        }


def seconds_since(then: float | None, now: float) -> float:
    """Seconds from `then` to `now`; infinite when it never happened."""
    return math.inf if then is None else now - then


class History:
    """What the loop remembers between ticks: recent signals, when it last acted, and what the predictive floor
    learned (kept by the caller)."""

    def __init__(
        self, keep_s: float = 3600.0, scaling: ScalingPolicy | None = None, signal_window_s: float = 0.0
    ) -> None:
        """`signal_window_s`: how far back the rate signals look (the PromQL rate window)."""
        scaling = scaling or ScalingPolicy()
        self.keep_s = keep_s
        self.samples: deque[Signals] = deque()
        self.loads: deque[tuple[float, float]] = deque()  # (time, forecast load in replicas) per tick with one
        self.last_scale_up: float | None = None
        self.last_scale_down: float | None = None
        self.last_retune: float | None = None
        self.last_ready: float | None = None  # when the replicas of the last scale-up were all serving
        self.last_moves: dict[str, tuple[float, int]] = {}  # knob -> (time, +1 up / -1 down) of its last retune
        self.forecast = RateForecast(period_s=scaling.period_s)
        self.bursts = BurstMemory(keep_s=keep_s)
        self.capacity = CapacityProfile(hints=scaling.capacity_hints, window_s=signal_window_s)
        self.cold_start = ColdStart(default=scaling.cold_start_s)
        self.interval_s = scaling.interval_s

    def follow(self, scaling: ScalingPolicy) -> None:
        """Take up what an edit of spec.autoscaling changed since the history was made: the capacity hints, the
        assumed cold start, the tick, and the daily period (a new period starts its profile afresh)."""
        self.capacity.hints = scaling.capacity_hints
        self.cold_start.default = scaling.cold_start_s
        self.interval_s = scaling.interval_s
        if self.forecast.period_s != scaling.period_s:
            self.forecast = RateForecast(period_s=scaling.period_s)

    def record(self, signals: Signals, decision: Decision) -> None:
        """Remember this tick's reading and the decision taken on it (call after carrying it out)."""
        now = signals.time
        self.samples.append(signals)
        while self.samples and now - self.samples[0].time > self.keep_s:
            self.samples.popleft()
        if decision.load is not None:
            self.loads.append((now, decision.load))
        while self.loads and now - self.loads[0][0] > self.keep_s:
            self.loads.popleft()
        if signals.arrival_rate is not None:
            self.forecast.update(now, signals.arrival_rate, self.horizon_s())
            # a run of high readings longer than two horizons is a change of level, which the floor can follow
            self.bursts.update(now, signals.arrival_rate, max_len_s=2 * self.horizon_s())
        before = replace(decision.engine, **{k: old for k, (old, _) in decision.changes.items()})
        finish, waiting, running, busy = signals.finish_rate, signals.queue_depth, signals.running, signals.device_busy
        if finish is not None and waiting is not None and running is not None and busy is not None:
            self.capacity.update(now, before.max_num_seqs, finish, signals.seen_replicas(), waiting, running, busy)
        if decision.action == SCALE_UP:
            self.last_scale_up = now
            self.cold_start.scaled_up(now)
        elif decision.action == SCALE_DOWN:
            self.last_scale_down = now
        elif decision.action == RETUNE:
            self.last_retune = now
            for knob, (old, new) in decision.changes.items():
                self.last_moves[knob] = (now, 1 if new > old else -1)
        if self.cold_start.track(now, decision.replicas, signals.ready_replicas):
            self.last_ready = now

    def horizon_s(self) -> float:
        """How far ahead the floor must look: a new replica's start-up plus one tick."""
        return self.cold_start.seconds() + self.interval_s

    def expected_rate(self, now: float) -> float | None:
        """The highest arrival rate the forecast expects within the horizon; None before any reading."""
        return None if self.forecast.level is None else self.forecast.predict(now, self.horizon_s())

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
