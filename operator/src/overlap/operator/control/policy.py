"""The control loop's policy: a pure function from load signals to a decision (no Kubernetes, no Prometheus).

`decide(signals, current, history, policy) -> Decision` is called once per tick for each InferenceService. The
operator's timer (overlap.operator.control.loop) reads the signals from Prometheus and carries the decision out; the
closed-loop trace replay (`overlap bench control`) calls the same function on simulated replicas.

Replicas follow whichever of three rules asks for more:

- the predictive floor: the arrival rate forecast one cold start ahead (overlap.operator.control.forecast) over
  the requests/s a saturated replica was measured to finish, at the target utilisation. Replicas still starting
  count, so it may move while they start (at most doubling the fleet per step);
- the queue watermark: waiting requests per ready replica above `queueWatermarkPerReplica` for a whole scale-up
  window scale up proportionally (like the HPA's `ceil(replicas x load / target)`);
- the SLO law: P90 TTFT or P90 time per output token over its objective for a whole scale-up window scales up by
  the ratio (at most double).

The two reactive rules wait while replicas start (a backlog built during a cold start does not shrink in proportion
to the replicas on their way, so scaling again on it overshoots), and give way to a larger batch while the engines
have headroom (tune before scale). Scale-in needs a whole quiet scale-down window, latency averaged under 0.8 of
its SLO over it, and the recent forecast load to fit the smaller fleet with a margin (no 2 <-> 1 flapping); it goes
as far as that allows, at most half the fleet per step. With `minReplicas` 0 the last replica goes after an idle timeout
without arrivals, and the first request the activator holds brings one back at once. A signal whose query failed
holds everything; the per-replica figures are over the pods Prometheus scraped.

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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from overlap.operator.control.forecast import CapacityProfile, ColdStart, RateForecast, quantile
from overlap.operator.spec import DEFAULTS, ENGINE_FIELDS, SCALING_MODES, TUNABLE_KNOBS

# Thresholds of the tuning table above (shares and ratios, 0..1).
KV_PRESSURE = 0.90  # KV usage above this: preemptions are near
QUEUEING_SHARE = 0.6  # queue time above this share of end-to-end latency: latency is mostly waiting
EXECUTION_SHARE = 0.3  # queue time below this share: latency is mostly execution (in between: hold)
UNDO_AFTER_INTERVALS = 3  # a knob's last move may be reversed only after this many tuning intervals
DEVICE_IDLE = 0.70  # device busy below this while requests wait: the host is the bottleneck
# Tune before scale: the batch is this full (running per replica / max_num_seqs) and the KV cache under this.
BATCH_FULL = 0.9
KV_HEADROOM = 0.7
SCALE_IN_MARGIN = 0.1  # scale in only when the forecast load fits N - 1 replicas with this much to spare
FLOOR_TOLERANCE = 0.05  # the floor adds replicas only for a load this much above the fleet
SCALE_IN_SLO = 0.8  # scale in only when latency averaged under this share of its SLO (0.8-1: the dead band)
SLO_PROPORTIONAL = 1.5  # the SLO law adds one replica below this latency / objective ratio, in proportion above
BUSY_FLEET = 0.7  # forecast load above this share of the fleet: the tuner makes no move that costs throughput

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
    """What runs now: the replica count asked for and the engines' live knobs (snake_case, EngineConfig names)."""

    replicas: int
    engine: Mapping[str, float]


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
    """spec.tuning; bounds maps a knob (snake_case) to its (min, max)."""

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
                bounds={ENGINE_FIELDS[k]: (bounds[k]["min"], bounds[k]["max"]) for k in TUNABLE_KNOBS if k in bounds},
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
    engine: Mapping[str, float]  # the live knobs to run (unchanged unless retuning)
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
            "engine": dict(self.engine),
        }


class History:
    """What the loop remembers between ticks: recent signals, when it last acted, and what the predictive floor
    learned (kept by the caller)."""

    def __init__(self, keep_s: float = 3600.0, scaling: ScalingPolicy | None = None) -> None:
        scaling = scaling or ScalingPolicy()
        self.keep_s = keep_s
        self.samples: deque[Signals] = deque()
        self.loads: deque[tuple[float, float]] = deque()  # (time, forecast load in replicas) per tick with one
        self.last_scale_up: float | None = None
        self.last_scale_down: float | None = None
        self.last_retune: float | None = None
        self.last_moves: dict[str, tuple[float, int]] = {}  # knob -> (time, +1 up / -1 down) of its last retune
        self.forecast = RateForecast(period_s=scaling.period_s)
        self.capacity = CapacityProfile(hints=scaling.capacity_hints)
        self.cold_start = ColdStart(default=scaling.cold_start_s)
        self.interval_s = scaling.interval_s

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
        before = {**decision.engine, **{k: old for k, (old, _) in decision.changes.items()}}
        finish, waiting, running, busy = signals.finish_rate, signals.queue_depth, signals.running, signals.device_busy
        if finish is not None and waiting is not None and running is not None and busy is not None:
            seqs = int(before.get("max_num_seqs", 0))
            self.capacity.update(seqs, finish, signals.seen_replicas(), waiting, running, busy)
        if decision.action == SCALE_UP:
            self.last_scale_up = now
            self.cold_start.scaled_up(now)
        elif decision.action == SCALE_DOWN:
            self.last_scale_down = now
        elif decision.action == RETUNE:
            self.last_retune = now
            for knob, (old, new) in decision.changes.items():
                self.last_moves[knob] = (now, 1 if new > old else -1)
        self.cold_start.track(now, decision.replicas, signals.ready_replicas)

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


def decide(signals: Signals, current: Current, history: History, policy: Policy) -> Decision:
    """This tick's decision. Scaling comes first: a retune measured across a replica change would mislead.

    The replica count follows whichever rule asks for more: the predictive floor (the forecast arrival rate over
    the measured capacity per replica; replicas still starting count, so it may move while they start), the queue
    watermark and the SLO law (both reactive: they wait for starting replicas). A reactive scale-up is replaced by
    a larger batch while the engines have headroom (tune before scale). Scale-in goes as far as the forecast load
    allows (at most half the fleet per step), and only when the smaller fleet carries it."""
    scaling = policy.scaling
    engine = dict(current.engine)
    floor = _floor(signals, current, history, scaling) if scaling.scales else None

    marks = {"floor": floor.replicas, "load": floor.load} if floor is not None else {}

    def decision(action: str, reason: str, replicas: int = current.replicas) -> Decision:
        return Decision(action, reason, replicas, engine, **marks)

    if scaling.scales:
        if signals.stale:
            return decision(HOLD, f"stale signals ({', '.join(signals.stale)}): holding until they read again")
        bounded = _bounds(current, scaling)
        if bounded is not None:
            return decision(*bounded)
        woken = _from_zero(signals, current, floor, scaling)
        if woken is not None:
            return decision(*woken)
        # Within a small tolerance of the fleet the floor holds (its target utilisation is the headroom already);
        # at most double per step, like the reactive rules' bound: an early capacity figure can be low.
        if floor is not None and floor.load > current.replicas * (1 + FLOOR_TOLERANCE):
            target = min(floor.replicas, scaling.max_replicas, max(2 * current.replicas, current.replicas + 1))
            if target > current.replicas:
                return decision(SCALE_UP, f"predictive floor {floor.replicas}: {floor.why}", target)
    pending = current.replicas - signals.ready_replicas
    stuck = None
    if pending > 0 and signals.queue_depth is not None and scaling.scales:
        # Pending since the last scale move, or since the loop's first reading if it never moved.
        since = history.last_scale()
        if since is None:
            since = history.samples[0].time if history.samples else signals.time
        waited = signals.time - since
        if waited < scaling.startup_deadline_s:
            reason = f"{pending} of {current.replicas} replicas still starting; waiting for them before the next move"
            return decision(HOLD, reason)
        stuck = (
            f"{pending} of {current.replicas} replicas not ready {waited:.0f} s after the last scale "
            f"(start-up deadline {scaling.startup_deadline_s:g} s): scaling on the ready ones"
        )
    if scaling.scales:
        up = _reactive_up(signals, current, history, scaling, policy.tuning.signal_window_s)
        if up is not None:
            tuned = _tune_before_scale(signals, current, history, policy.tuning, up[1]) if stuck is None else None
            if tuned is not None:
                return replace(tuned, **marks)
            if _since(history.last_retune, signals.time) >= policy.tuning.interval_s or not policy.tuning.enabled:
                return decision(SCALE_UP, up[1], up[0])
        down = _scale_in(signals, current, history, scaling, floor)
        if down is not None:
            return decision(*down)
    if policy.tuning.enabled and stuck is None:  # a retune measured on a fleet with stuck replicas would mislead
        tuned = _tune(signals, current, history, policy.tuning, None if floor is None else floor.load)
        if tuned is not None:
            return replace(tuned, **marks)
    return decision(HOLD, stuck or _hold_reason(signals, policy))


def _since(then: float | None, now: float) -> float:
    return math.inf if then is None else now - then


def _bounds(current: Current, policy: ScalingPolicy) -> tuple[str, str, int] | None:
    low, high = policy.min_replicas, policy.max_replicas
    if low <= current.replicas <= high:
        return None
    target = min(max(current.replicas, low), high)
    action = SCALE_UP if target > current.replicas else SCALE_DOWN
    return action, f"replicas {current.replicas} outside {low}..{high}", target


def _from_zero(
    signals: Signals, current: Current, floor: Floor | None, policy: ScalingPolicy
) -> tuple[str, str, int] | None:
    """At zero replicas any request, held by the activator or counted on arrival, brings one back at once."""
    if current.replicas > 0:
        return None
    held, arriving = signals.activator_queue or 0, signals.arrival_rate or 0
    if held <= 0 and arriving <= 0:
        return None
    target = min(max(1, floor.replicas if floor else 1), policy.max_replicas)
    return SCALE_UP, f"{held:g} requests held by the activator at zero replicas", target


class Floor(NamedTuple):
    """What the forecast arrival rate needs at the measured capacity and the target utilisation."""

    replicas: int  # at least min_replicas
    why: str
    load: float  # in replicas, unrounded


def _floor(signals: Signals, current: Current, history: History, policy: ScalingPolicy) -> Floor | None:
    """The predictive floor; None before both a forecast and a capacity are known."""
    if not policy.predictive or signals.arrival_rate is None:
        return None
    capacity = history.capacity.get(int(current.engine.get("max_num_seqs", 0)))
    if capacity is None:
        return None
    horizon = history.horizon_s()
    rate = history.forecast.predict_with(signals.time, signals.arrival_rate, horizon)
    load = rate / (capacity * policy.target_utilization)
    replicas = math.ceil(load - 1e-9)
    why = (
        f"{rate:.1f} req/s expected within {horizon:.0f} s, {capacity:.1f} req/s per replica at "
        f"{policy.target_utilization:.0%} utilisation"
    )
    return Floor(max(replicas, policy.min_replicas), why, load)


def _slo_ratio(signals: Signals, policy: ScalingPolicy) -> float | None:
    """The SLO law's reading: the larger of P90 TTFT / its SLO and P90 time per output token / its SLO."""
    ratios = [
        value / slo
        for value, slo in ((signals.ttft_p90_s, policy.ttft_slo_s), (signals.itl_p90_s, policy.tpot_slo_s))
        if value is not None and slo
    ]
    return max(ratios) if ratios else None


def _reactive_up(
    signals: Signals, current: Current, history: History, policy: ScalingPolicy, signal_window_s: float
) -> tuple[int, str] | None:
    """(target, why) from the queue watermark or the SLO law, each held for the whole scale-up window. The SLO law
    also waits a signal window after a scale-up: until then its latency percentiles still hold the backlog the new
    replicas were added for."""
    high, now = policy.max_replicas, signals.time
    if current.replicas >= high or _since(history.last_scale_up, now) < policy.up_cooldown_s:
        return None
    covered = policy.up_window_s == 0 or history.covers(now, policy.up_window_s)
    if not covered:
        return None
    window = [*history.window(now, policy.up_window_s), signals]
    per_replica = signals.waiting_per_replica()
    wanted: list[tuple[int, str]] = []
    if per_replica is not None and all(
        (v := s.waiting_per_replica()) is not None and v > policy.up_watermark for s in window
    ):
        replicas = math.ceil(signals.seen_replicas() * per_replica / policy.up_watermark)
        why = (
            f"{per_replica:.1f} waiting per ready replica > watermark {policy.up_watermark:g} "
            f"for {policy.up_window_s:g} s"
        )
        wanted.append((replicas, why))
    ratio = _slo_ratio(signals, policy)
    settled = _since(history.last_scale_up, now) >= signal_window_s
    if settled and ratio is not None and all((r := _slo_ratio(s, policy)) is not None and r > 1 for s in window):
        # Near the objective one more replica (latency is far from proportional to load near capacity); far over
        # it, in proportion, at most double.
        seen = signals.seen_replicas()
        replicas = seen + 1 if ratio < SLO_PROPORTIONAL else math.ceil(seen * min(ratio, 2.0))
        wanted.append((replicas, f"latency at {ratio:.2f}x its SLO (P90 TTFT, P90 TPOT) for {policy.up_window_s:g} s"))
    if not wanted:
        return None
    replicas, why = max(wanted)
    return min(high, max(current.replicas + 1, replicas)), why


def _scale_in(
    signals: Signals, current: Current, history: History, policy: ScalingPolicy, floor: Floor | None
) -> tuple[str, str, int] | None:
    """Fewer replicas when the queue stayed under the scale-down watermark for the whole window, latency averaged
    under SCALE_IN_SLO of its objective over it, and the forecast load over the longer of the window and the cooldown
    fits N - 1 replicas with a margin (load x N / (N - 1) under capacity): down to what carries it, at most half the
    fleet per step, one at a time without a forecast. To zero only after the idle timeout without a single
    arrival."""
    now, n = signals.time, current.replicas
    # A scale-up is not undone within the cooldown; after a scale-in, the next one needs a whole fresh window.
    if n <= policy.min_replicas or _since(history.last_scale_up, now) < policy.down_cooldown_s:
        return None
    if _since(history.last_scale_down, now) < max(policy.down_window_s, policy.interval_s):
        return None
    per_replica = signals.waiting_per_replica()
    if per_replica is None or per_replica >= policy.down_watermark:
        return None
    if policy.down_window_s and not history.covers(now, policy.down_window_s):
        return None
    window = [*history.window(now, policy.down_window_s), signals]
    if not all((v := s.waiting_per_replica()) is not None and v < policy.down_watermark for s in window):
        return None
    ratios = [r for s in window if (r := _slo_ratio(s, policy)) is not None]
    if ratios and sum(ratios) / len(ratios) > SCALE_IN_SLO:
        return None  # latency was near or over its SLO over the window: fewer replicas would breach it
    # the load over the longer of the window and the cooldown: the spikes of the last minutes count too
    look_back = max(policy.down_window_s, policy.down_cooldown_s)
    loads = [load for t, load in history.loads if now - t <= look_back] + ([floor.load] if floor else [])
    # the margin is at least what the forecast has been missing by, so the next tick's floor does not undo this
    margin = max(SCALE_IN_MARGIN, history.forecast.relative_error or 0.0)
    # the window's load: its 90th percentile, so one noisy reading does not hold a whole fleet
    load = quantile(loads, 0.9) if loads else None
    if load is not None and load * (1 + margin) > n - 1:
        return None  # the others would not carry the load
    if n == 1:  # to zero: only when nothing has arrived for the idle timeout
        idle = [*history.window(now, policy.idle_timeout_s), signals]
        if not history.covers(now, policy.idle_timeout_s) or any((s.arrival_rate or 0) > 0 for s in idle):
            return None
        return SCALE_DOWN, f"no requests for {policy.idle_timeout_s:g} s: scaling to zero", 0
    why = f"{per_replica:.1f} waiting per ready replica < {policy.down_watermark:g} for {policy.down_window_s:g} s"
    if load is None:
        return SCALE_DOWN, why, n - 1  # no forecast to size the step: one replica at a time
    # as far as the forecast load allows with the margin, at most half the fleet per step
    target = max(math.ceil(load * (1 + margin) - 1e-9), math.ceil(n / 2), policy.min_replicas, 1)
    why += (
        f"; {target} replicas carry the forecast load ({load:.2f} replicas at the target utilisation, "
        f"margin {margin:.0%})"
    )
    return SCALE_DOWN, why, target


def _move(engine: Mapping[str, float], knob: str, policy: TuningPolicy, factor: float, step: int = 0):
    """The engine with `knob` scaled by `factor` (or stepped by `step`) inside its bounds; None if it can't move."""
    if knob not in policy.bounds or knob not in engine:
        return None
    lo, hi = policy.bounds[knob]
    old = engine[knob]
    new = int(min(max(old + step if step else round(old * factor), lo), hi))
    return None if new == old else {**engine, knob: new}


def _undoes(
    history: History, knob: str, engine: Mapping[str, float], moved: Mapping[str, float], now: float, settle_s: float
) -> bool:
    """Would this reverse the knob's own last move, made less than UNDO_AFTER_INTERVALS waits ago?"""
    when, direction = history.last_moves.get(knob, (None, 0))
    recent = _since(when, now) < UNDO_AFTER_INTERVALS * settle_s
    return recent and (moved[knob] - engine[knob]) * direction < 0


def _tune_before_scale(
    signals: Signals, current: Current, history: History, policy: TuningPolicy, why: str
) -> Decision | None:
    """A larger batch instead of a replica, while the batch is full, the KV cache has room and the knob can rise."""
    if not policy.enabled:
        return None
    engine = dict(current.engine)
    seqs, replicas = engine.get("max_num_seqs"), signals.seen_replicas()
    kv, running = signals.kv_cache_usage, signals.running
    if seqs is None or kv is None or running is None or replicas <= 0:
        return None
    if kv >= KV_HEADROOM or running / replicas < BATCH_FULL * seqs:
        return None
    moved = _move(engine, "max_num_seqs", policy, 2)
    settle_s = policy.settle_s
    if moved is None or _undoes(history, "max_num_seqs", engine, moved, signals.time, settle_s):
        return None
    text = f"tune before scale ({why}; batch full, KV {kv:.0%}): max_num_seqs {seqs:g} -> {moved['max_num_seqs']:g}"
    return Decision(RETUNE, text, current.replicas, moved, {"max_num_seqs": (seqs, moved["max_num_seqs"])})


def _tune(
    signals: Signals, current: Current, history: History, policy: TuningPolicy, load: float | None = None
) -> Decision | None:
    """The tuning table's move, if any. `load`: the forecast load in replicas, when the floor has one; while it is
    above BUSY_FLEET of the fleet, no move shrinks the batch or the step budget (they cost throughput)."""
    now = signals.time
    settle_s = policy.settle_s
    if _since(history.last_move(), now) < settle_s:
        return None  # the last move's effect is not in the readings yet
    engine = dict(current.engine)
    signals = _averaged([*history.window(now, policy.interval_s), signals])

    def retune(candidates: list[tuple[str, float, int]], why: str) -> Decision | None:
        for knob, factor, step in candidates:
            moved = _move(engine, knob, policy, factor, step)
            if moved is None or _undoes(history, knob, engine, moved, now, settle_s):
                continue
            shrinks = knob in ("max_num_seqs", "max_num_batched_tokens") and moved[knob] < engine[knob]
            if shrinks and load is not None and load > BUSY_FLEET * current.replicas:
                continue  # a smaller batch or step costs throughput the forecast load needs
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
