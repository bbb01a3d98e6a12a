"""The scaling rules beyond the queue watermark, on hand-made readings: the SLO law with warming pods, the
predictive floor, tune before scale, safe scale-in, zero traffic and scale to zero, a failing scrape, a stale
signal, advisory mode. `decide` is pure; each test builds a History and a sequence of Signals."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from overlap.engine.config import EngineConfig
from overlap.operator.control.decide import decide
from overlap.operator.control.forecast import BurstMemory, CapacityProfile, ColdStart, RateForecast
from overlap.operator.control.policy import (
    HOLD,
    RETUNE,
    SCALE_DOWN,
    SCALE_UP,
    Current,
    History,
    Policy,
    ScalingPolicy,
    Signals,
    TuningPolicy,
)

ENGINE = EngineConfig(num_buffers=2).live  # max_num_seqs 64, max_num_batched_tokens 2048, num_buffers 2
BASE = ScalingPolicy(
    mode="builtin",
    min_replicas=1,
    max_replicas=10,
    up_window_s=30,
    down_window_s=60,
    up_cooldown_s=0,
    down_cooldown_s=0,
    interval_s=15,
    cold_start_s=60,
    target_utilization=0.8,
)


def scaling(**changes) -> ScalingPolicy:
    return replace(BASE, **changes)


def run(
    readings: list[dict],
    policy: Policy,
    replicas: int,
    history: History | None = None,
    step_s: float = 15,
    start_s: float = 0,
):
    """Tick the loop over readings (Signals fields; ready_replicas defaults to the replicas asked for) from
    `start_s`, carrying each decision out; the decisions in order."""
    history = history or History(scaling=policy.scaling)
    current, decisions = Current(replicas, ENGINE), []
    for i, fields in enumerate(readings):
        signals = Signals(time=start_s + i * step_s, **{"ready_replicas": current.replicas, **fields})
        decision = decide(signals, current, history, policy)
        history.record(signals, decision)
        current = Current(decision.replicas, decision.engine)
        decisions.append(decision)
    return decisions


# ---------------------------------------------------------------------------------------------- SLO law


def test_slo_law_scales_up_after_a_whole_window_over_the_slo():
    policy = Policy(scaling=scaling(ttft_slo_s=1.0, tpot_slo_s=0.05, predictive=False))
    over = {"queue_depth": 10, "ttft_p90_s": 1.5, "itl_p90_s": 0.02}  # TTFT at 1.5x its SLO, TPOT within
    decisions = run([over] * 3, policy, replicas=2)
    assert [d.action for d in decisions] == [HOLD, HOLD, SCALE_UP]
    assert decisions[-1].replicas == 3  # ceil(2 x 1.5)
    assert "1.50x its SLO" in decisions[-1].reason
    near = {"queue_depth": 10, "ttft_p90_s": 1.2, "itl_p90_s": 0.02}  # 1.2x: one more replica, not 20% more
    assert run([near] * 3, policy, replicas=6)[-1].replicas == 7


def test_ttft_over_its_slo_with_nobody_waiting_is_a_backlog_already_served():
    """The window's P90 TTFT still holds the requests of a backlog that is gone: with the queue empty it does not
    scale. Time per output token over its objective does (the running batches are too large for it)."""
    policy = Policy(scaling=scaling(ttft_slo_s=1.0, tpot_slo_s=0.05, predictive=False))
    served = {"queue_depth": 0, "ttft_p90_s": 1.5, "itl_p90_s": 0.02}
    assert all(d.action == HOLD for d in run([served] * 3, policy, replicas=2))
    slow_tokens = {"queue_depth": 0, "ttft_p90_s": 0.5, "itl_p90_s": 0.08}
    assert run([slow_tokens] * 3, policy, replicas=2)[-1].action == SCALE_UP


def test_slo_law_takes_the_worse_objective_and_caps_the_step_at_double():
    policy = Policy(scaling=scaling(ttft_slo_s=1.0, tpot_slo_s=0.05, predictive=False))
    over = {"queue_depth": 0, "ttft_p90_s": 0.5, "itl_p90_s": 0.5}  # TPOT at 10x
    assert run([over] * 3, policy, replicas=3)[-1].replicas == 6


def test_slo_law_waits_for_warming_pods():
    policy = Policy(scaling=scaling(ttft_slo_s=1.0, predictive=False))
    over = {"queue_depth": 0, "ttft_p90_s": 3.0, "ready_replicas": 2}  # 2 of 4 ready: 2 still starting
    decisions = run([over] * 4, policy, replicas=4)
    assert all(d.action == HOLD for d in decisions)
    assert "2 of 4 replicas still starting" in decisions[-1].reason


# ---------------------------------------------------------------------------------------------- predictive floor


def learned_history(policy: Policy, capacity: float = 50.0) -> History:
    history = History(scaling=policy.scaling)
    history.capacity.samples[ENGINE.max_num_seqs] = deque([capacity] * history.capacity.min_readings)
    return history


def test_the_floor_scales_up_on_a_ramp_before_any_queue_builds():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)  # 50 req/s per replica, planned at 80%: 40
    ramp = [{"queue_depth": 0, "arrival_rate": 60 + 20 * i} for i in range(8)]
    decisions = run(ramp, policy, replicas=2, history=history)
    ups = [(i, d.replicas) for i, d in enumerate(decisions) if d.action == SCALE_UP]
    assert ups, [d.reason for d in decisions]
    first, target = ups[0]
    rate_then = 60 + 20 * first
    assert target * 40 > rate_then  # ahead of the load, not behind it
    assert all(r["queue_depth"] == 0 for r in ramp[: first + 1])  # nothing was waiting
    assert "predictive floor" in decisions[first].reason and "req/s per replica" in decisions[first].reason


def test_the_floor_counts_replicas_still_starting():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)
    # 4 asked, 1 ready: the floor for 150 req/s at 40 per replica is 4, already asked for
    readings = [{"queue_depth": 0, "arrival_rate": 150, "ready_replicas": 1}] * 3
    decisions = run(readings, policy, replicas=4, history=history)
    assert all(d.action == HOLD for d in decisions)
    assert all(d.floor == 4 for d in decisions)


def test_while_replicas_start_the_floor_adds_more_only_on_a_higher_reading():
    """The replicas on their way were sized for the reading their scale-up was made on. After a spike the trend
    keeps rising for a few ticks while the reading falls: the floor does not add more on it, only on a reading
    above the one it scaled on."""
    policy = Policy(scaling=scaling(up_window_s=0))
    history = learned_history(policy)  # 40 req/s per replica at the target
    readings = [
        {"queue_depth": 0, "arrival_rate": 300, "ready_replicas": 2},  # floor 8: at most double, 2 -> 4
        {"queue_depth": 0, "arrival_rate": 280, "ready_replicas": 2},  # lower: the 2 starting were sized for 300
        {"queue_depth": 0, "arrival_rate": 400, "ready_replicas": 2},  # higher: more
    ]
    decisions = run(readings, policy, replicas=2, history=history)
    assert [(d.action, d.replicas) for d in decisions] == [(SCALE_UP, 4), (HOLD, 4), (SCALE_UP, 8)], [
        d.reason for d in decisions
    ]


def test_recurring_bursts_hold_the_floor_at_their_peak_until_they_stop():
    """Bursts of one tick at 5x the base rate every 8 ticks: each is over before a replica started for it would
    serve. From the second burst on, the floor holds for their peak at the measured capacity and BURST_EXCESS over it
    (no scale-in, no flapping, no reactive chase of the queue a burst leaves); once no burst came for three of their
    gaps, it follows the base rate again."""
    policy = Policy(scaling=scaling(up_window_s=0))
    history = learned_history(policy)  # 50 req/s per replica
    quiet = {"queue_depth": 0, "arrival_rate": 40}
    burst = {"queue_depth": 300, "arrival_rate": 200}  # 300 waiting: over the watermark on any fleet up to 10
    readings = [quiet] * 4 + ([burst] + [quiet] * 7) * 3 + [quiet] * 30  # bursts at ticks 4, 12, 20
    decisions = run(readings, policy, replicas=4, history=history)
    assert history.bursts.mean_gap_s() == 120
    held = decisions[14:45]  # from the tick after the second burst ended until three gaps after the last one began
    assert [d.floor for d in held] == [4] * len(held), [(d.floor, d.reason) for d in decisions]
    # the third burst's queue is not chased; the fleet the first one was chased with comes in to the held peak with
    # the scale-in margin: 200 req/s over 50 per replica and BURST_EXCESS is 3.48 replicas, x 1.1 fits 4
    assert not any(d.action == SCALE_UP for d in held), [d.reason for d in held]
    assert min(d.replicas for d in held) == 4, [d.reason for d in held]
    assert decisions[-1].floor == 1  # they stopped: the base rate's floor again
    # a rise that stays (a daily peak) is a change of level, not a burst: nothing held for it once it is over
    history = learned_history(policy)
    rise = [quiet] * 4 + [{**burst, "queue_depth": 0}] * 12 + [quiet] * 8
    decisions = run(rise, policy, replicas=1, history=history)
    assert len(history.bursts.bursts) == 0 and decisions[-1].floor == 1


def test_a_held_fleet_scales_in_to_the_bursts_peak_whatever_the_forecast_missed():
    """The hold replaces the trend's forecast, so the trend's misses (large on bursts) are not the scale-in margin:
    an oversized fleet comes down to the held peak plus the usual margin, and no further."""
    policy = Policy(scaling=scaling())
    history = learned_history(policy)
    quiet, burst = {"queue_depth": 0, "arrival_rate": 40}, {"queue_depth": 0, "arrival_rate": 200}
    run([quiet] * 4 + ([burst] + [quiet] * 7) * 3, policy, replicas=4, history=history)  # held from tick 13
    assert history.bursts.recurring_peak(27 * 15) == 200
    decisions = run([quiet] * 7 + [burst] + [quiet] * 7, policy, replicas=8, history=history, start_s=28 * 15)
    assert history.forecast.relative_error > 0.3  # as the margin it would keep 3.48 x 1.3 -> 5 replicas or more
    assert decisions[-1].replicas == 4, [d.reason for d in decisions]  # 3.48 held (200 / (50 x 1.15)), 10% margin


def test_small_bursts_do_not_lower_the_peak_held_for_and_a_burst_after_a_long_gap_is_held_for():
    memory = BurstMemory()
    t = 0.0

    def feed(rates: list[float]) -> None:
        nonlocal t
        for rate in rates:
            memory.update(t, rate, max_len_s=30)
            t += 15

    feed([40] * 4 + [200] + [40] * 3 + [200] + [40] * 3)  # two bursts to 200, 60 s apart
    assert memory.recurring_peak(t) == 200
    feed(([100] + [40] * 3) * 6)  # six bursts to 100: the 75th percentile of the peaks is now 100
    assert memory.recurring_peak(t) == 200
    feed([40] * 20)  # 300 s without a burst: more than three of their mean gaps
    assert memory.recurring_peak(t) is None
    feed([300])  # a burst begins: it counts as the last, so it is held for while it runs, not chased
    assert memory.recurring_peak(t) == 100  # the hold starts over from the peaks' quantile
    feed([40])
    assert memory.bursts[-1][1] == 300 and memory.recurring_peak(t) == 200  # nine peaks now: the 7th is 200


def test_a_long_run_at_the_start_does_not_lift_the_base_over_the_bursts_after_it():
    """The base is the median of the readings outside runs of high ones: a trace that opens with a long run (a
    change of level, not a burst) would otherwise put the base, and the burst threshold, over the bursts that
    follow it."""
    memory = BurstMemory()
    rates = [40] + [200] * 10 + [40] * 4 + ([150] + [40] * 3) * 3  # a long run, then three bursts to 150
    for i, rate in enumerate(rates):
        memory.update(i * 15.0, rate, max_len_s=30)
    assert memory.base() == 40
    assert [peak for _, peak in memory.bursts] == [150, 150, 150]  # the long run is not one of them
    assert memory.recurring_peak(len(rates) * 15.0) == 150


def test_the_slo_law_waits_out_the_latency_of_a_burst_that_is_over():
    """Latency percentiles over a window still hold the backlog of a burst that has ended: the SLO law waits a
    signal window after it, then scales if latency is still over its objective."""
    policy = Policy(
        scaling=scaling(ttft_slo_s=1.0, predictive=False, up_window_s=15),
        tuning=TuningPolicy(enabled=False, signal_window_s=60),
    )
    quiet = {"queue_depth": 0, "arrival_rate": 40, "ttft_p90_s": 0.2}
    slow = {"queue_depth": 5, "arrival_rate": 40, "ttft_p90_s": 2.0}  # requests still wait: not only the burst's
    readings = [quiet] * 8 + [{**slow, "arrival_rate": 200}] + [slow] * 6
    decisions = run(readings, policy, replicas=2)
    ups = [i for i, d in enumerate(decisions) if d.action == SCALE_UP]
    assert ups and ups[0] == 13, [(i, d.action, d.reason) for i, d in enumerate(decisions)]  # burst ended at tick 9


def test_without_a_measured_capacity_there_is_no_floor():
    policy = Policy(scaling=scaling())
    decisions = run([{"queue_depth": 0, "arrival_rate": 500}] * 3, policy, replicas=1)
    assert all(d.action == HOLD and d.floor is None for d in decisions)


def test_capacity_is_learned_only_from_saturated_readings():
    profile = CapacityProfile()
    profile.update(0, 64, finish_rate=30, replicas=2, waiting=0, running=20, busy=0.95)  # idle: not saturated
    profile.update(1, 64, finish_rate=30, replicas=2, waiting=4, running=60, busy=0.95)  # a few between steps
    assert profile.samples == {}
    for t in range(profile.min_readings - 1):
        profile.update(t, 64, finish_rate=100, replicas=2, waiting=10, running=120, busy=0.97)  # full batches
    assert profile.get(64) is None  # too few readings to trust
    profile.update(9, 64, finish_rate=90, replicas=2, waiting=40, running=80, busy=0.97)  # a long queue
    assert profile.get(64) == pytest.approx(50)  # the 90th percentile of 50, 50, 45
    for _ in range(10):  # low readings (a window that began before the saturation) do not drag it down
        profile.update(10, 64, finish_rate=60, replicas=2, waiting=40, running=128, busy=0.97)
    assert profile.get(64) == pytest.approx(50)
    for _ in range(profile.keep):  # a workload that stays slower ages the old figure out
        profile.update(11, 64, finish_rate=60, replicas=2, waiting=40, running=128, busy=0.97)
    assert profile.get(64) == pytest.approx(30)
    assert profile.get(128) is None  # another limit's figure does not stand in: it would never be corrected


def test_capacity_is_read_only_once_the_replicas_were_saturated_for_a_whole_rate_window():
    """The finish rate is a rate over a window: a burst shorter than it saturates the replicas for part of it, and
    the rate then says less than they can do. Readings count once saturation has lasted the window."""
    profile = CapacityProfile(window_s=60, min_readings=1)
    saturated = {"replicas": 2, "waiting": 40, "running": 128, "busy": 0.97}
    for t in (0, 15, 30, 45):  # saturated for 45 s: the window still holds what came before
        profile.update(t, 64, finish_rate=60, **saturated)
    profile.update(50, 64, finish_rate=60, replicas=2, waiting=0, running=10, busy=0.3)  # it ends
    for t in (60, 75, 90, 105):
        profile.update(t, 64, finish_rate=100 + t, **saturated)
    assert profile.get(64) is None  # saturated again from 60 s: 45 s so far
    profile.update(120, 64, finish_rate=160, **saturated)
    assert profile.get(64) == pytest.approx(80)  # the first reading with a whole window saturated


def test_a_larger_batch_is_tried_only_where_the_capacity_profile_expects_it_to_pay():
    """A larger max_num_seqs costs every request latency. The tuning table raises it when latency is mostly
    queueing only where the profile says a replica finishes BATCH_GAIN more at the larger limit (figures of one
    kind: both offline here); a limit it knows nothing of is tried."""
    slow = {"queue_depth": 40, "p99_latency_s": 5.0, "queue_time_share": 0.8}
    tuning = TuningPolicy(enabled=True, interval_s=30, signal_window_s=30, p99_slo_s=2.0, bounds=TUNING.bounds)

    def first_move(hints: dict[int, float]):
        policy = Policy(scaling=scaling(predictive=False, capacity_hints=hints), tuning=tuning)
        decisions = run([slow] * 3, policy, replicas=2)
        return next((d for d in decisions if d.action != HOLD), decisions[-1])

    compute_bound = first_move({64: 80.0, 128: 84.0})  # 5% more for twice the batch
    assert compute_bound.action == HOLD, compute_bound.reason
    memory_bound = first_move({64: 80.0, 128: 140.0})
    assert memory_bound.changes == {"max_num_seqs": (64, 128)}
    assert first_move({64: 80.0}).changes == {"max_num_seqs": (64, 128)}  # unknown at 128: tried


def test_the_forecast_follows_a_trend_and_learns_a_daily_profile():
    forecast = RateForecast(period_s=100, buckets=10)
    for t in range(0, 50):  # a steady ramp of 2 req/s per second
        forecast.update(float(t), 10 + 2.0 * t, horizon_s=5)
    assert forecast.predict(49, 10) > 10 + 2 * 49  # the trend carries it beyond the last reading
    day = RateForecast(period_s=100, buckets=10)
    shape = [10 if (t % 100) < 50 else 100 for t in range(0, 200)]  # a quiet half, then a busy half, twice
    for t, rate in enumerate(shape):
        day.update(float(t), float(rate), horizon_s=10)
    quiet_forecast = day.predict(245, 10)  # in the quiet half of day three, with the busy half 5 s ahead
    assert quiet_forecast > 50  # the profile remembers what comes next; the trend alone would say ~10
    assert day.relative_error is not None


def test_cold_start_is_learned_from_observed_starts():
    cold = ColdStart(default=60)
    cold.scaled_up(100)
    cold.track(100, asked=3, ready=1)
    cold.track(115, asked=3, ready=2)
    cold.track(130, asked=3, ready=3)
    assert cold.seconds() == pytest.approx(30)
    policy = Policy(scaling=scaling())
    history = learned_history(policy)
    readings = [{"queue_depth": 0, "arrival_rate": 100, "ready_replicas": r} for r in (1, 1, 3, 3)]
    run(readings, policy, replicas=1, history=history)  # the floor asks 3 at t=0; ready at t=30
    assert history.cold_start.seconds() == pytest.approx(30)


# ---------------------------------------------------------------------------------------------- tune before scale

TUNING = TuningPolicy(enabled=True, interval_s=30, signal_window_s=30, bounds={"max_num_seqs": (8, 256)})


def test_a_full_batch_with_kv_headroom_is_raised_before_a_replica_is_added():
    policy = Policy(scaling=scaling(predictive=False), tuning=TUNING)
    busy = {"queue_depth": 100, "batch_size": 64, "kv_cache_usage": 0.3}  # 50 waiting per replica, batches full
    decisions = run([busy] * 3, policy, replicas=2)
    assert decisions[-1].action == RETUNE
    assert decisions[-1].engine.max_num_seqs == 128 and "tune before scale" in decisions[-1].reason
    assert decisions[-1].replicas == 2


def test_a_finish_between_steps_does_not_turn_the_raise_into_a_replica():
    # The running count read just after sequences finished (before the next step admits the waiting ones) is low;
    # the batch was full all along, and the mean batch of the recent steps says so.
    policy = Policy(scaling=scaling(predictive=False), tuning=TUNING)
    dipped = {"queue_depth": 100, "running": 30, "batch_size": 63, "kv_cache_usage": 0.3}
    decisions = run([dipped] * 3, policy, replicas=2)
    assert decisions[-1].action == RETUNE and decisions[-1].engine.max_num_seqs == 128


def test_a_batch_that_has_just_filled_is_raised_before_the_mean_batch_shows_it():
    policy = Policy(scaling=scaling(predictive=False), tuning=TUNING)
    filled = {"queue_depth": 100, "running": 128, "batch_size": 40, "kv_cache_usage": 0.3}
    assert run([filled] * 3, policy, replicas=2)[-1].action == RETUNE


def test_a_batch_not_full_while_requests_wait_adds_the_replica():
    # Something else holds the batch back (the step's token budget): a larger max_num_seqs would not help.
    policy = Policy(scaling=scaling(predictive=False), tuning=TUNING)
    half = {"queue_depth": 100, "running": 60, "batch_size": 30, "kv_cache_usage": 0.3}
    assert run([half] * 3, policy, replicas=2)[-1].action == SCALE_UP


def test_after_the_raise_a_still_breached_slo_adds_the_replica():
    policy = Policy(scaling=scaling(predictive=False), tuning=TUNING)
    busy = {"queue_depth": 100, "batch_size": 64, "kv_cache_usage": 0.3}
    full_kv = {"queue_depth": 100, "batch_size": 128, "kv_cache_usage": 0.8}  # after the raise: KV has no headroom
    decisions = run([busy, busy, busy, full_kv, full_kv, full_kv], policy, replicas=2)
    actions = [d.action for d in decisions]
    assert actions[2] == RETUNE and SCALE_UP in actions[3:]
    up = actions.index(SCALE_UP)
    assert (up - 2) * 15 >= TUNING.interval_s  # a whole tuning interval to show the raise's effect first


def test_no_headroom_scales_at_once():
    policy = Policy(scaling=scaling(predictive=False), tuning=TUNING)
    busy = {"queue_depth": 100, "batch_size": 64, "kv_cache_usage": 0.85}  # KV nearly full: the batch cannot grow
    assert run([busy] * 3, policy, replicas=2)[-1].action == SCALE_UP


# ---------------------------------------------------------------------------------------------- safe scale-in


def test_no_scale_in_while_n_minus_one_replicas_would_not_carry_the_load():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)  # 40 req/s per replica at the target
    # an empty queue, but 150 req/s: 3.75 replicas of load, 4 running: 3 would be over capacity
    decisions = run([{"queue_depth": 0, "arrival_rate": 150}] * 8, policy, replicas=4, history=history)
    assert SCALE_DOWN not in [d.action for d in decisions]


def test_scale_in_when_the_others_carry_the_load_with_margin():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)
    decisions = run([{"queue_depth": 0, "arrival_rate": 100}] * 8, policy, replicas=4, history=history)
    downs = [d for d in decisions if d.action == SCALE_DOWN]
    assert downs and downs[0].replicas == 3  # 2.5 replicas of load: 3 carry it (2.5 x 1.1 <= 3)
    assert all(d.replicas >= 3 for d in decisions)  # never to 2: 2.5 x 1.1 > 2
    assert "3 replicas carry the forecast load" in downs[0].reason


def test_no_scale_in_while_latency_sits_in_the_dead_band_below_its_slo():
    policy = Policy(scaling=scaling(ttft_slo_s=1.0, predictive=False))
    near = {"queue_depth": 0, "ttft_p90_s": 0.9}  # met, but at 0.9 of it: one replica fewer would breach it
    assert SCALE_DOWN not in [d.action for d in run([near] * 8, policy, replicas=4)]
    low = {"queue_depth": 0, "ttft_p90_s": 0.5}
    assert SCALE_DOWN in [d.action for d in run([low] * 8, policy, replicas=4)]


def test_no_two_to_one_flapping_on_a_load_just_over_one_replica():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)  # 1.2 replicas of load, noisy: never 2 -> 1 -> 2
    readings = [{"queue_depth": 0, "arrival_rate": 48 + (6 if i % 2 else -6)} for i in range(30)]
    decisions = run(readings, policy, replicas=2, history=history)
    assert [d.action for d in decisions if d.action != HOLD] == []


# ---------------------------------------------------------------------------------------------- zero traffic


def test_zero_traffic_scales_down_though_the_latency_signals_are_nan():
    policy = Policy(scaling=scaling(ttft_slo_s=1.0))
    idle = {"queue_depth": None, "arrival_rate": 0.0, "p99_latency_s": None, "ttft_p90_s": None}
    decisions = run([idle] * 10, policy, replicas=3)
    assert [d.replicas for d in decisions if d.action == SCALE_DOWN] == [2, 1]


def test_to_zero_after_the_idle_timeout_and_back_on_the_first_held_request():
    policy = Policy(scaling=scaling(min_replicas=0, idle_timeout_s=120))
    idle = {"queue_depth": 0, "arrival_rate": 0.0}
    decisions = run([idle] * 10, policy, replicas=1)
    down = [i for i, d in enumerate(decisions) if d.action == SCALE_DOWN]
    assert down and decisions[down[0]].replicas == 0 and down[0] * 15 >= 120
    assert "no requests for 120 s" in decisions[down[0]].reason
    history = History(scaling=policy.scaling)
    woken = decide(Signals(0, 0, activator_queue=7), Current(0, ENGINE), history, policy)
    assert woken.action == SCALE_UP and woken.replicas == 1 and "7 requests held by the activator" in woken.reason


def test_one_arrival_inside_the_idle_timeout_keeps_the_last_replica():
    policy = Policy(scaling=scaling(min_replicas=0, idle_timeout_s=120))
    readings = [{"queue_depth": 0, "arrival_rate": 0.0}] * 6 + [{"queue_depth": 0, "arrival_rate": 0.1}]
    readings += [{"queue_depth": 0, "arrival_rate": 0.0}] * 6
    decisions = run(readings, policy, replicas=1)
    assert all(d.replicas == 1 for d in decisions)


def test_no_arrival_rate_reading_never_counts_as_an_idle_service():
    """An arrival-rate query that answers nothing (a Prometheus without the service label, an override that selects
    nothing) is no reading, not zero traffic: the last replica stays."""
    policy = Policy(scaling=scaling(min_replicas=0, idle_timeout_s=120))
    decisions = run([{"queue_depth": 0, "arrival_rate": None}] * 12, policy, replicas=1)
    assert all(d.replicas == 1 for d in decisions)


# ---------------------------------------------------------------------------------------------- robust signals


def test_a_pod_that_fails_its_scrape_does_not_block_the_others():
    policy = Policy(scaling=scaling(predictive=False, up_window_s=0))
    # 3 ready, 2 scraped: the 80 waiting are over the 2 seen (40 each > 32), not the 3 (26.7)
    signals = Signals(0, ready_replicas=3, queue_depth=80, scraped_replicas=2)
    decision = decide(signals, Current(3, ENGINE), History(scaling=policy.scaling), policy)
    assert decision.action == SCALE_UP and decision.replicas == 3 + 1
    assert "40.0 waiting per ready replica" in decision.reason


def test_a_stale_signal_holds_and_says_which():
    policy = Policy(scaling=scaling(predictive=False, up_window_s=0))
    signals = Signals(0, ready_replicas=2, queue_depth=500, stale=("kvCacheUsage",))
    decision = decide(signals, Current(2, ENGINE), History(scaling=policy.scaling), policy)
    assert decision.action == HOLD and "stale signals (kvCacheUsage)" in decision.reason


# ---------------------------------------------------------------------------------------------- advisory mode


def test_advisory_mode_decides_what_builtin_would():
    readings = [{"queue_depth": 100 * (i + 1), "arrival_rate": 20.0 * i} for i in range(6)]
    builtin = run(readings, Policy(scaling=scaling()), replicas=2)
    advise = run(readings, Policy(scaling=scaling(mode="advise")), replicas=2)
    assert [(d.action, d.replicas) for d in advise] == [(d.action, d.replicas) for d in builtin]
    assert any(d.action == SCALE_UP for d in advise)


def test_an_offline_capacity_figure_stands_in_until_the_loop_measures_one():
    profile = CapacityProfile(hints={64: 80.0})
    assert profile.get(64) == 80.0
    assert profile.get(128) is None  # a figure holds at the limit it was measured at
    for t in range(profile.min_readings):
        profile.update(t, 64, finish_rate=120, replicas=2, waiting=40, running=128, busy=0.97)
    assert profile.get(64) == pytest.approx(60)  # measured: the pods' own figure wins
    policy = Policy(scaling=scaling(capacity_hints={64: 50.0}))
    decisions = run([{"queue_depth": 0, "arrival_rate": 150}] * 2, policy, replicas=2)
    assert decisions[0].action == SCALE_UP and decisions[0].replicas == 4  # ceil(150 / (50 x 0.8))


def test_scale_in_goes_as_far_as_the_load_allows_but_halves_the_fleet_at_most():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)  # 40 req/s per replica at the target
    decisions = run([{"queue_depth": 0, "arrival_rate": 20}] * 14, policy, replicas=8, history=history)
    downs = [(i * 15, d.replicas) for i, d in enumerate(decisions) if d.action == SCALE_DOWN]
    assert downs == [(60, 4), (120, 2), (180, 1)]  # each after a fresh quiet window (60 s) at the new size


def test_a_scale_up_is_not_undone_within_the_cooldown():
    policy = Policy(scaling=scaling(down_cooldown_s=120))
    history = learned_history(policy)
    readings = [{"queue_depth": 0, "arrival_rate": 150}] + [{"queue_depth": 0, "arrival_rate": 20}] * 14
    decisions = run(readings, policy, replicas=2, history=history)
    moves = [(i * 15, d.action) for i, d in enumerate(decisions) if d.action != HOLD]
    assert moves[0] == (0, SCALE_UP) and moves[1][1] == SCALE_DOWN and moves[1][0] >= 120


def test_the_floor_holds_within_its_tolerance():
    policy = Policy(scaling=scaling())
    history = learned_history(policy)  # 40 req/s per replica at the target
    # 5.09 replicas of load on 5: within 5%, the target utilisation's headroom covers it
    assert run([{"queue_depth": 0, "arrival_rate": 203.6}], policy, replicas=5, history=history)[0].action == HOLD
    history = learned_history(policy)
    assert run([{"queue_depth": 0, "arrival_rate": 215}], policy, replicas=5, history=history)[0].action == SCALE_UP


def test_an_edit_of_the_autoscaling_spec_reaches_a_running_loops_history():
    """The loop keeps its History across ticks: a capacity hint, cold start, tick or period the user sets later is
    taken up at the next tick, not at the operator's next restart."""
    history = History(scaling=scaling())
    assert history.capacity.get(64) is None
    edited = scaling(capacity_hints={64: 12.5}, cold_start_s=90.0, interval_s=30.0, period_s=3600.0)
    history.follow(edited)
    assert history.capacity.get(64) == 12.5 and history.horizon_s() == 90.0 + 30.0
    assert history.forecast.period_s == 3600.0
