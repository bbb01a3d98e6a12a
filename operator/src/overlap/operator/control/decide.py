"""The control loop's decision: a pure function from load signals to a decision (no Kubernetes, no Prometheus).

`decide(signals, current, history, policy) -> Decision` is called once per tick for each InferenceService. The
operator's timer (overlap.operator.control.loop) reads the signals from Prometheus and carries the decision out; the
closed-loop trace replay (`overlap bench control`) calls the same function on simulated replicas.

Replicas follow whichever of three rules asks for more:

- the predictive floor: the arrival rate forecast one cold start ahead (overlap.operator.control.forecast) over
  the requests/s a saturated replica was measured to finish, at the target utilisation; or while bursts of the rate
  recur, a high quantile of their peaks over that capacity and BURST_EXCESS more (a burst shorter than a cold start
  is over before a replica started for it serves: it is held for, not chased). Replicas still starting count, so
  it may move while they start (at most doubling the fleet per step), on a reading above the one it last scaled on;
- the queue watermark: waiting requests per ready replica above `queueWatermarkPerReplica` for a whole scale-up
  window scale up proportionally (like the HPA's `ceil(replicas x load / target)`);
- the SLO law: P90 TTFT (while requests wait) or P90 time per output token over its objective for a whole scale-up
  window scales up by the ratio (at most double).

The two reactive rules wait while replicas start (a backlog built during a cold start does not shrink in proportion
to the replicas on their way, so scaling again on it overshoots) and while bursts are held for, and give way to a
larger batch while the engines have headroom (tune before scale). Scale-in needs a whole quiet scale-down window,
latency averaged under 0.8 of its SLO over it, and the recent forecast load to fit the smaller fleet with a margin
(no 2 <-> 1 flapping); it goes as far as that allows, at most half the fleet per step. With `minReplicas` 0 the last
replica goes after an idle timeout without arrivals, and the first request the activator holds brings one back at
once. A signal whose query failed holds everything; the per-replica figures are over the pods Prometheus scraped.

Engine knobs: overlap.operator.control.tuning.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from overlap.operator.control.forecast import quantile
from overlap.operator.control.policy import (
    HOLD,
    SCALE_DOWN,
    SCALE_UP,
    Current,
    Decision,
    History,
    Policy,
    ScalingPolicy,
    Signals,
    seconds_since,
)
from overlap.operator.control.tuning import tune, tune_before_scale

# Thresholds of the scaling rules (shares and ratios).
SCALE_IN_MARGIN = 0.1  # scale in only when the forecast load fits N - 1 replicas with this much to spare
FLOOR_TOLERANCE = 0.05  # the floor adds replicas only for a load this much above the fleet
SCALE_IN_SLO = 0.8  # scale in only when latency averaged under this share of its SLO (0.8-1: the dead band)
SLO_PROPORTIONAL = 1.5  # the SLO law adds one replica below this latency / objective ratio, in proportion above
# A held burst peak may exceed the fleet's capacity by this share: the peak is a high quantile of one rate window's
# arrivals, and what it brings over the fleet queues for a fraction of the window (set on the bursts:1-3 replays).
BURST_EXCESS = 0.15


def decide(signals: Signals, current: Current, history: History, policy: Policy) -> Decision:
    """This tick's decision. Scaling comes first: a retune measured across a replica change would mislead.

    The replica count follows whichever rule asks for more: the predictive floor (the forecast arrival rate over
    the measured capacity per replica; replicas still starting count, so it may move while they start), the queue
    watermark and the SLO law (both reactive: they wait for starting replicas). A reactive scale-up is replaced by
    a larger batch while the engines have headroom (tune before scale). Scale-in goes as far as the forecast load
    allows (at most half the fleet per step), and only when the smaller fleet carries it."""
    scaling = policy.scaling
    engine = current.engine
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
        if (
            floor is not None
            and floor.load > current.replicas * (1 + FLOOR_TOLERANCE)
            and _rising(signals, current, history)
        ):
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
    # While bursts recur the floor is sized for their peak (and scales up to it above): the reactive rules would
    # chase a burst that is over before the replica they add serves (and give it back after), so they wait.
    held = floor is not None and history.bursts.recurring_peak(signals.time) is not None
    if scaling.scales:
        up = None if held else _reactive_up(signals, current, history, scaling, policy.tuning.signal_window_s)
        if up is not None:
            tuned = tune_before_scale(signals, current, history, policy.tuning, up[1]) if stuck is None else None
            if tuned is not None:
                return replace(tuned, **marks)
            retuned_s = seconds_since(history.last_retune, signals.time)
            if retuned_s >= policy.tuning.interval_s or not policy.tuning.enabled:
                return decision(SCALE_UP, up[1], up[0])
        down = _scale_in(signals, current, history, scaling, floor)
        if down is not None:
            return decision(*down)
    if policy.tuning.enabled and stuck is None:  # a retune measured on a fleet with stuck replicas would mislead
        # the recent peak load, not this tick's: a batch shrunk in a lull between bursts is short in the next one
        tuned = tune(signals, current, history, policy.tuning, _recent_load(history, signals.time, scaling, floor))
        if tuned is not None:
            return replace(tuned, **marks)
    return decision(HOLD, stuck or _hold_reason(signals, policy))


def _rising(signals: Signals, current: Current, history: History) -> bool:
    """While replicas start, the floor adds more only on an arrival-rate reading above the one its last scale-up was
    made on: the replicas on their way were sized for that reading, and the trend keeps rising for a few ticks after
    a spike in the reading has passed."""
    last = history.last_scale_up
    if last is None or signals.arrival_rate is None or signals.ready_replicas >= current.replicas:
        return True  # no scale-up, or every replica asked for serves
    then = next((s.arrival_rate for s in reversed(history.samples) if s.time == last), None)
    return then is None or signals.arrival_rate > then


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
    capacity = history.capacity.get(current.engine.max_num_seqs)
    if capacity is None:
        return None
    horizon = history.horizon_s()
    rate = history.forecast.predict_with(signals.time, signals.arrival_rate, horizon)
    expected = f"{rate:.1f} req/s expected within {horizon:.0f} s"
    peak = history.bursts.recurring_peak(signals.time)
    # Bursts too short to chase are held for while they recur: their peak, in place of the trend, which rises with
    # each burst and decays after it (chasing it would add replicas that serve after the burst is over).
    # The peak is a high quantile of theirs already, and what a burst brings over the fleet queues briefly: it is
    # planned at the whole measured capacity and BURST_EXCESS over it.
    utilization = policy.target_utilization
    if peak is not None:
        rate, utilization = peak, 1.0 + BURST_EXCESS
        expected = f"bursts to {peak:.1f} req/s recur every ~{history.bursts.mean_gap_s():.0f} s (held while they do)"
    load = rate / (capacity * utilization)
    replicas = math.ceil(load / (1 + FLOOR_TOLERANCE) - 1e-9)  # the fleet the floor would hold at (below)
    why = f"{expected}, {capacity:.1f} req/s per replica at {utilization:.0%} utilisation"
    return Floor(max(replicas, policy.min_replicas), why, load)


def _slo_ratio(signals: Signals, policy: ScalingPolicy, ttft: bool = True) -> float | None:
    """The SLO law's reading: the larger of P90 TTFT / its SLO and P90 time per output token / its SLO (the latter
    alone without `ttft`)."""
    readings = [(signals.ttft_p90_s if ttft else None, policy.ttft_slo_s), (signals.itl_p90_s, policy.tpot_slo_s)]
    ratios = [value / slo for value, slo in readings if value is not None and slo]
    return max(ratios) if ratios else None


def _reactive_up(
    signals: Signals, current: Current, history: History, policy: ScalingPolicy, signal_window_s: float
) -> tuple[int, str] | None:
    """(target, why) from the queue watermark or the SLO law, each held for the whole scale-up window. The SLO law
    also waits a signal window after a scale-up's replicas are all serving, and after the end of a burst: until then
    its latency percentiles still hold the backlog the new replicas were added for, or the burst's, which is
    served."""
    high, now = policy.max_replicas, signals.time
    if current.replicas >= high or seconds_since(history.last_scale_up, now) < policy.up_cooldown_s:
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

    def law(s: Signals) -> float | None:
        # TTFT over its objective says requests wait too long only while some wait: with the queue empty it is a
        # backlog already served (its requests are still in the window's percentile)
        return _slo_ratio(s, policy, ttft=(s.queue_depth or 0) > 0)

    ratio = law(signals)
    since = min(seconds_since(history.last_scale_up, now), seconds_since(history.last_ready, now))
    if signals.arrival_rate is not None:
        since = min(since, history.bursts.since_burst_s(now, signals.arrival_rate))
    settled = since >= signal_window_s
    if settled and ratio is not None and all((r := law(s)) is not None and r > 1 for s in window):
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
    if n <= policy.min_replicas or seconds_since(history.last_scale_up, now) < policy.down_cooldown_s:
        return None
    if seconds_since(history.last_scale_down, now) < max(policy.down_window_s, policy.interval_s):
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
    load = _recent_load(history, now, policy, floor)
    # the margin is at least what the forecast has been missing by, so the next tick's floor does not undo this;
    # while bursts are held for, the floor is their peak, not the forecast, and its misses do not count
    missed = 0.0 if history.bursts.recurring_peak(now) is not None else history.forecast.relative_error or 0.0
    margin = max(SCALE_IN_MARGIN, missed)
    if load is not None and load * (1 + margin) > n - 1:
        return None  # the others would not carry the load
    if n == 1:  # to zero: only when nothing has arrived for the idle timeout
        idle = [*history.window(now, policy.idle_timeout_s), signals]
        # every reading of the timeout says no arrivals: one the query did not answer is not a quiet one
        if not history.covers(now, policy.idle_timeout_s) or any(s.arrival_rate != 0 for s in idle):
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


def _recent_load(history: History, now: float, policy: ScalingPolicy, floor: Floor | None) -> float | None:
    """The forecast load (replicas) over the longer of the scale-down window and cooldown, this tick's included: its
    90th percentile, so the spikes of the last minutes count and one noisy reading does not; None without one."""
    look_back = max(policy.down_window_s, policy.down_cooldown_s)
    loads = [load for t, load in history.loads if now - t <= look_back] + ([floor.load] if floor else [])
    return quantile(loads, 0.9) if loads else None


def _hold_reason(signals: Signals, policy: Policy) -> str:
    per_replica = signals.waiting_per_replica()
    if per_replica is None:
        return "no queue signal (no ready replica, or Prometheus has no series yet)"
    return f"{per_replica:.1f} waiting per ready replica; within watermarks, nothing to retune"
