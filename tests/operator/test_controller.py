"""The control loop's policy: `decide` on hand-made signal sequences (pure, no Kubernetes)."""

from __future__ import annotations

import pytest

from overlap.engine.config import EngineConfig
from overlap.operator import spec as specs
from overlap.operator.control.decide import decide
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
SCALING = ScalingPolicy(
    mode="builtin",
    min_replicas=1,
    max_replicas=8,
    up_watermark=32,
    down_watermark=4,
    up_window_s=30,
    down_window_s=120,
    up_cooldown_s=60,
    down_cooldown_s=120,
    interval_s=15,
)


def run(waiting_per_replica: list[float], policy: Policy, replicas: int = 2, step_s: float = 15) -> list:
    """Tick the loop over a sequence of readings, carrying each decision out; the decisions in order."""
    history, current, decisions = History(), Current(replicas, ENGINE), []
    for i, per_replica in enumerate(waiting_per_replica):
        signals = Signals(time=i * step_s, ready_replicas=current.replicas, queue_depth=per_replica * current.replicas)
        decision = decide(signals, current, history, policy)
        history.record(signals, decision)
        current = Current(decision.replicas, decision.engine)
        decisions.append(decision)
    return decisions


def test_scales_up_only_after_a_whole_window_above_the_watermark():
    decisions = run([40, 40, 40], Policy(scaling=SCALING))
    # t=0 and t=15: the window (30 s) is not covered yet; t=30: it is, every reading above 32.
    assert [d.action for d in decisions] == [HOLD, HOLD, SCALE_UP]
    assert "watermark 32" in decisions[2].reason


def test_a_dip_below_the_watermark_restarts_the_window():
    decisions = run([40, 40, 10, 40, 40, 40], Policy(scaling=SCALING))
    assert [d.action for d in decisions] == [HOLD, HOLD, HOLD, HOLD, HOLD, SCALE_UP]


def test_scale_up_is_proportional_and_capped_at_max_replicas():
    decisions = run([100, 100, 100], Policy(scaling=SCALING), replicas=2)
    assert decisions[-1].replicas == 7  # ceil(2 x 100 / 32)
    decisions = run([400, 400, 400], Policy(scaling=SCALING), replicas=2)
    assert decisions[-1].replicas == 8


def test_cooldown_spaces_scale_ups():
    decisions = run([40] * 8, Policy(scaling=SCALING))
    ups = [i * 15 for i, d in enumerate(decisions) if d.action == SCALE_UP]
    assert ups == [30, 90]  # 60 s cooldown; the window is already covered after the first move


def test_scales_down_one_replica_after_the_window_below_and_the_cooldown():
    decisions = run([1] * 12, Policy(scaling=SCALING), replicas=4)
    downs = [(i * 15, d.replicas) for i, d in enumerate(decisions) if d.action == SCALE_DOWN]
    assert downs == [(120, 3)]  # window 120 s covered at t=120, then 120 s of cooldown (next would be t=240)


def test_never_below_min_or_above_max_and_out_of_bounds_is_put_back():
    policy = Policy(scaling=SCALING)
    assert all(d.replicas >= 1 for d in run([0] * 40, policy, replicas=1))
    decision = decide(Signals(0, 9, 0), Current(9, ENGINE), History(), policy)
    assert (decision.action, decision.replicas) == (SCALE_DOWN, 8)
    assert "outside 1..8" in decision.reason


@pytest.mark.parametrize("mode", ["off", "external"])
def test_other_modes_never_scale(mode):
    policy = Policy(scaling=ScalingPolicy(mode=mode, up_window_s=0, up_cooldown_s=0))
    assert {d.action for d in run([500] * 5, policy)} == {HOLD}


def test_missing_signal_holds_and_says_why():
    decision = decide(Signals(0, ready_replicas=0), Current(2, ENGINE), History(), Policy(scaling=SCALING))
    assert decision.action == HOLD and "no queue signal" in decision.reason


TUNING = TuningPolicy(
    enabled=True,
    interval_s=30,
    bounds={"max_num_seqs": (16, 128), "max_num_batched_tokens": (512, 4096), "num_buffers": (1, 3)},
    p99_slo_s=2.0,
    signal_window_s=30,  # the latency readings look back as far as the interval (the operator's is a minute)
)


def tune_once(engine=ENGINE, tuning=TUNING, **readings) -> object:
    signals = Signals(time=100, ready_replicas=1, **readings)
    return decide(signals, Current(1, engine), History(), Policy(tuning=tuning))


def test_kv_pressure_halves_the_batch():
    decision = tune_once(queue_depth=10, kv_cache_usage=0.97)
    assert decision.action == RETUNE and decision.engine.max_num_seqs == 32
    assert decision.changes == {"max_num_seqs": (64, 32)}


def test_latency_over_slo_from_queueing_raises_the_batch_from_execution_lowers_it():
    queueing = tune_once(queue_depth=50, p99_latency_s=5.0, queue_time_share=0.8)
    assert queueing.engine.max_num_seqs == 128 and "80% of it queueing" in queueing.reason
    execution = tune_once(queue_depth=0, p99_latency_s=5.0, queue_time_share=0.1)
    assert execution.engine.max_num_seqs == 32


def test_at_the_bound_the_next_knob_moves():
    at_floor = ENGINE.replace(max_num_seqs=16)
    decision = tune_once(at_floor, queue_depth=0, p99_latency_s=5.0, queue_time_share=0.1)
    assert decision.changes == {"max_num_batched_tokens": (2048, 1024)}


def test_idle_device_with_a_queue_adds_a_buffer_then_raises_the_batch():
    decision = tune_once(queue_depth=20, device_busy=0.4)
    assert decision.changes == {"num_buffers": (2, 3)}
    decision = tune_once(ENGINE.replace(num_buffers=3), queue_depth=20, device_busy=0.4)
    assert decision.changes == {"max_num_seqs": (64, 128)}


def test_idle_device_without_a_queue_is_left_alone():
    assert tune_once(queue_depth=0, device_busy=0.1).action == HOLD


def test_idle_lulls_between_saturated_bursts_are_not_a_starved_device():
    """Busy is judged over the readings in which requests waited: bursts that saturate the device with a queue,
    between lulls with an idle device and none, average under DEVICE_IDLE but the host fed the device whenever
    there was work; the same mean busy with requests waiting throughout is the host falling behind."""

    def last_decision(readings: list[tuple[float, float]]):
        history, policy = History(), Policy(tuning=TUNING)
        for i, (waiting, busy) in enumerate(readings):
            signals = Signals(i * 5, 1, waiting, device_busy=busy)
            decision = decide(signals, Current(1, ENGINE), history, policy)
            history.record(signals, decision)
        return decision

    bursts = [(0, 0.1), (0, 0.1), (40, 1.0), (0, 0.1), (0, 0.1), (40, 1.0), (0, 0.1)]  # mean busy 0.37
    assert last_decision(bursts).action == HOLD
    starved = [(20, 0.4)] * 7
    assert last_decision(starved).changes == {"num_buffers": (2, 3)}
    # the queue is read at an instant, busy over the interval: a burst that lands at the end of an idle interval
    # has a queue and an idle reading, but the device was not starved (nothing waited through the interval)
    arrivals = [(0, 0.1), (40, 0.3)] * 3 + [(0, 0.1)]
    assert last_decision(arrivals).action == HOLD


def test_knobs_without_bounds_are_never_tuned_and_retunes_keep_their_interval():
    tuning = TuningPolicy(enabled=True, interval_s=30, bounds={"num_buffers": (1, 2)})
    assert tune_once(tuning=tuning, queue_depth=20, kv_cache_usage=0.99).action == HOLD
    history = History()
    policy = Policy(tuning=TUNING)
    first = decide(Signals(0, 1, 20, device_busy=0.4), Current(1, ENGINE), history, policy)
    history.record(Signals(0, 1, 20, device_busy=0.4), first)
    again = decide(Signals(15, 1, 20, device_busy=0.4), Current(1, first.engine), history, policy)
    later = decide(Signals(30, 1, 20, device_busy=0.4), Current(1, first.engine), history, policy)
    assert (first.action, again.action, later.action) == (RETUNE, HOLD, RETUNE)


def test_scaling_goes_before_tuning():
    policy = Policy(scaling=ScalingPolicy(mode="builtin", up_window_s=0, up_cooldown_s=0), tuning=TUNING)
    decision = decide(Signals(0, 1, 100, device_busy=0.2), Current(1, ENGINE), History(), policy)
    assert decision.action == SCALE_UP and decision.engine == ENGINE


def test_policy_from_a_defaulted_spec():
    spec = specs.with_defaults(
        {
            "model": {"servedName": "m", "path": "/models/m"},
            "autoscaling": {"mode": "builtin", "maxReplicas": 6},
            "tuning": {
                "enabled": True,
                "bounds": {"numBuffers": {"min": 1, "max": 3}},
                "latencySLO": {"p99Seconds": 4},
            },
        }
    )
    policy = Policy.from_spec(spec)
    assert policy.scaling.max_replicas == 6 and policy.scaling.up_watermark == 32
    assert policy.tuning.bounds == {"num_buffers": (1, 3)} and policy.tuning.p99_slo_s == 4
    assert policy.interval_s() == 15
    assert Policy().interval_s() == float("inf")
    # The dataclasses' defaults are the CRD's (the bench builds its policies from them).
    bare = specs.with_defaults({"model": {"servedName": "m", "path": "/models/m"}})
    assert Policy.from_spec(bare) == Policy()


def test_offline_capacity_figures_belong_to_their_batch_limits():
    predictive = {
        "capacityPerReplica": 30,
        "capacityProfile": [{"maxNumSeqs": 64, "requestsPerSecond": 50}, {"maxNumSeqs": 8, "requestsPerSecond": 9}],
    }
    spec = specs.with_defaults(
        {
            "model": {"servedName": "m", "path": "/models/m"},
            "engine": {"maxNumSeqs": 16},
            "autoscaling": {"mode": "builtin", "predictive": predictive},
        }
    )
    assert Policy.from_spec(spec).scaling.capacity_hints == {16: 30.0, 64: 50.0, 8: 9.0}


def test_decision_status_matches_the_crd():
    decision = decide(Signals(0, 1, 0), Current(1, ENGINE), History(), Policy())
    status = decision.to_status("2026-01-01T00:00:00Z")
    assert set(status) == {"time", "action", "reason", "replicas", "engine"}


def test_nothing_moves_while_replicas_are_still_starting():
    policy = Policy(scaling=ScalingPolicy(mode="builtin", up_window_s=0, up_cooldown_s=0), tuning=TUNING)
    # Asked for 3, 1 ready: the backlog built during the cold start must not trigger another scale-up.
    decision = decide(Signals(0, ready_replicas=1, queue_depth=500), Current(3, ENGINE), History(), policy)
    assert decision.action == HOLD and "2 of 3 replicas still starting" in decision.reason
    # Once they are ready, the same backlog scales again.
    decision = decide(Signals(0, ready_replicas=3, queue_depth=500), Current(3, ENGINE), History(), policy)
    assert decision.action == SCALE_UP


def test_the_tuner_waits_a_whole_interval_after_a_scale_move():
    history = History()
    history.last_scale_up = 90.0
    signals = Signals(time=100, ready_replicas=1, queue_depth=20, device_busy=0.4)
    assert decide(signals, Current(1, ENGINE), history, Policy(tuning=TUNING)).action == HOLD
    later = Signals(time=121, ready_replicas=1, queue_depth=20, device_busy=0.4)
    assert decide(later, Current(1, ENGINE), history, Policy(tuning=TUNING)).action == RETUNE


def test_between_queueing_and_execution_the_tuner_holds():
    assert tune_once(queue_depth=5, p99_latency_s=5.0, queue_time_share=0.45).action == HOLD


def test_readings_are_averaged_over_the_interval():
    history = History()
    for t in range(0, 100, 15):  # a calm interval...
        calm = Signals(t, 1, 2, device_busy=0.95, queue_time_share=0.1, p99_latency_s=0.5)
        history.record(calm, decide(calm, Current(1, ENGINE), history, Policy(tuning=TUNING)))
    spike = Signals(100, 1, 2, device_busy=0.95, queue_time_share=0.1, p99_latency_s=3.0)  # ...then one spike
    assert decide(spike, Current(1, ENGINE), history, Policy(tuning=TUNING)).action == HOLD  # mean P99 1.2 s
    assert tune_once(queue_depth=2, device_busy=0.95, queue_time_share=0.1, p99_latency_s=3.0).action == RETUNE


def test_a_retune_reports_the_whole_live_knobs_in_the_crds_spelling():
    decision = tune_once(kv_cache_usage=0.95)
    assert decision.engine == ENGINE.replace(max_num_seqs=32) and decision.changes == {"max_num_seqs": (64, 32)}
    reported = decision.to_status("2026-01-01T00:00:00Z")["engine"]
    # camelCase from LiveKnobs' fields; default_timeout_s, unset, is left out (a merge patch cannot store null)
    assert reported == {"maxNumSeqs": 32, "maxNumBatchedTokens": 2048, "numBuffers": 2, "agingSeconds": 5.0}


def test_the_tuner_does_not_undo_its_own_last_move_soon():
    history, engine = History(), ENGINE
    first = decide(Signals(0, 1, 50, p99_latency_s=5.0, queue_time_share=0.9), Current(1, engine), history,
                   Policy(tuning=TUNING))  # fmt: skip
    history.record(Signals(0, 1, 50, p99_latency_s=5.0, queue_time_share=0.9), first)
    assert first.changes == {"max_num_seqs": (64, 128)}
    execution = dict(p99_latency_s=5.0, queue_time_share=0.1)
    # 40 s later latency looks like execution: halving max_num_seqs would undo the last move, so the next knob moves.
    second = decide(Signals(40, 1, 0, **execution), Current(1, first.engine), History(), Policy(tuning=TUNING))
    assert second.changes == {"max_num_seqs": (128, 64)}  # (a fresh history has no last move to protect)
    guarded = decide(Signals(40, 1, 0, **execution), Current(1, first.engine), history, Policy(tuning=TUNING))
    assert guarded.changes == {"max_num_batched_tokens": (2048, 1024)}
    later = decide(Signals(100, 1, 0, **execution), Current(1, first.engine), history, Policy(tuning=TUNING))
    assert later.changes == {"max_num_seqs": (128, 64)}  # after 3 intervals (90 s) it may reverse


def test_after_a_move_the_tuner_waits_for_the_latency_window_too():
    tuning = TuningPolicy(enabled=True, interval_s=30, bounds={"num_buffers": (1, 3)}, signal_window_s=60)
    history = History()
    history.last_retune = 0.0
    waiting = {"ready_replicas": 1, "queue_depth": 20, "device_busy": 0.4}
    assert decide(Signals(45, **waiting), Current(1, ENGINE), history, Policy(tuning=tuning)).action == HOLD
    assert decide(Signals(61, **waiting), Current(1, ENGINE), history, Policy(tuning=tuning)).action == RETUNE


def test_stuck_replicas_hold_the_loop_only_until_the_startup_deadline():
    scaling = ScalingPolicy(mode="builtin", up_window_s=0, up_cooldown_s=0, down_window_s=0, down_cooldown_s=0,
                            startup_deadline_s=120)  # fmt: skip
    policy = Policy(scaling=scaling, tuning=TUNING)
    history = History()
    # Asked for 3 at t=0, one stays Pending for good (no GPU node); the load has gone.
    for t in (0, 60):
        signals = Signals(t, ready_replicas=2, queue_depth=0)
        decision = decide(signals, Current(3, ENGINE), history, policy)
        assert decision.action == HOLD and "still starting" in decision.reason
        history.record(signals, decision)
    decision = decide(Signals(130, ready_replicas=2, queue_depth=0), Current(3, ENGINE), history, policy)
    assert decision.action == SCALE_DOWN and decision.replicas == 2  # the stuck one can go
    # Between the watermarks past the deadline it holds, and says it no longer waits for the stuck one.
    between = decide(Signals(130, ready_replicas=2, queue_depth=20), Current(3, ENGINE), history, policy)
    assert between.action == HOLD and between.reason.startswith("1 of 3 replicas not ready 130 s after the last scale")
    # Over the watermark it scales up on the ready replicas' queue.
    busy = decide(Signals(130, ready_replicas=2, queue_depth=200), Current(3, ENGINE), history, policy)
    assert busy.action == SCALE_UP
