"""`overlap bench control`: the operator's decide() closed over simulated replicas, on a tiny synthetic trace."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

import pytest

from overlap.bench import control_replay
from overlap.bench.trace_generators import on_off_bursts
from overlap.cli import main
from overlap.engine.config import EngineConfig

# 1.5 s at 200 req/s, then 2.5 s at 20 req/s. A replica (5 ms + 150 us per token, 8 sequences, 8 + 16 tokens per
# request) serves ~73 req/s, so the first phase needs ~3 replicas and the second well under one.
MAX_REPLICAS = 4


@pytest.fixture(scope="module")
def burst_file(tmp_path_factory):
    trace = on_off_bursts(200, 20, on_s=1.5, off_s=2.5, duration_s=4, seed=3, prompt_tokens=(8, 8), max_tokens=(16, 16))
    path = tmp_path_factory.mktemp("control") / "burst.jsonl"
    trace.save_jsonl(path)
    return path


def control_args(trace, *extra) -> list[str]:
    # time scale 300: up window 0.1 s, down window and cooldown 1 s, tick 0.05 s
    return [
        "bench", "control", "--trace", str(trace), "--max-replicas", str(MAX_REPLICAS), "--max-num-seqs", "8",
        "--time-scale", "300", "--cold-start-s", "0.2", "--drain-s", "3", "--sim-cost", "5,150", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def report(burst_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("control-out")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        runs = "static-min,static-max,static-2,watermark,keda-queue,overlap"
        rc = main(control_args(burst_file, "--runs", runs, "--start-replicas", "1", "--json", "--out", str(out)))
    assert rc == 0, stderr.getvalue()
    return json.loads(stdout.getvalue()), out, stderr.getvalue()


# The P99 each autoscaler must reach, as a share of one replica's. The reactive watermark alone waits a whole up
# window and a cold start before each step, so it gains less, and how much less moves with the host's load; the
# others add replicas from the first window on.
P99_SHARE_OF_STATIC_MIN = {"watermark": 0.75, "keda-queue": 0.5, "overlap": 0.5}


@pytest.mark.parametrize("label", sorted(P99_SHARE_OF_STATIC_MIN))
def test_autoscalers_scale_up_then_down_and_lose_nothing(report, label):
    data, _, _ = report
    runs = {run["label"]: run for run in data["runs"]}
    auto = runs[label]
    actions = [d["action"] for d in auto["decisions"]]
    assert "scale-up" in actions and "scale-down" in actions
    assert actions.index("scale-up") < len(actions) - 1 - actions[::-1].index("scale-down")  # up first, down later
    assert auto["finished"] == auto["requests"] and auto["unfinished"] == 0 and auto["rejected"] == 0
    assert max(k["replicas"] for k in auto["timeline"]) > 1
    assert auto["timeline"][-1]["replicas"] < max(k["replicas"] for k in auto["timeline"])
    assert runs["static-min"]["replica_seconds"] < auto["replica_seconds"] < runs["static-max"]["replica_seconds"]
    # more replicas when the load needs them: autoscale beats one replica's P99 by a wide margin
    assert auto["latency_p99_ms"] < runs["static-min"]["latency_p99_ms"] * P99_SHARE_OF_STATIC_MIN[label]


def test_json_fields_are_consistent(report):
    data, out, log = report
    assert data["setup"]["scaling"]["max_replicas"] == MAX_REPLICAS
    assert data["setup"]["scaling"]["up_window_s"] == pytest.approx(30 / 300)
    for run in data["runs"]:
        assert run["finished"] + run["unfinished"] + run["rejected"] == run["requests"]
        assert run["mean_replicas"] == pytest.approx(run["replica_seconds"] / run["wall_s"], rel=0.02)
        assert run["scale_ups"] == sum(d["action"] == "scale-up" for d in run["decisions"])
        assert run["scale_downs"] == sum(d["action"] == "scale-down" for d in run["decisions"])
        assert all(1 <= k["replicas"] <= MAX_REPLICAS for k in run["timeline"])
        assert 0 <= run["slo_attainment"] <= run["finished"] / run["requests"]
        assert run["latency_p50_ms"] <= run["latency_p99_ms"]
        missed = run["requests"] - round(run["slo_attainment"] * run["requests"])
        assert sum(k["slo_misses"] for k in run["timeline"]) == missed
    static_max = data["runs"][1]
    assert static_max["label"] == "static-max" and static_max["decisions"] == []
    assert data["runs"][2]["label"] == "static-2" and data["runs"][2]["mean_replicas"] == pytest.approx(2, rel=0.02)
    assert data["setup"]["start_replicas"] == 1
    # the offline profile covers every limit the tuner can reach (it doubles and halves within 8..128)
    profile = {int(b): rps for b, rps in data["setup"]["capacity_profile_rps"].items()}
    assert sorted(profile) == [8, 16, 32, 64, 128]
    assert profile[8] == pytest.approx(data["setup"]["replica_capacity_rps"], abs=0.1)  # the start limit
    rates = [profile[b] for b in sorted(profile)]
    assert rates == sorted(rates)  # a larger batch never serves less on this cost model
    verdict = data["verdict"]
    assert len(verdict) == 5 and all(line.startswith("verdict: ") for line in verdict)
    assert all(line.endswith(("PASS", "FAIL")) for line in verdict[:4])
    assert "not run: static-3" in verdict[4]  # the fleets between min and max the run left out are named
    assert "verdict:" in log
    assert static_max["mean_replicas"] == pytest.approx(MAX_REPLICAS, rel=0.02)
    assert (out / "control.png").stat().st_size > 0 and (out / "report.json").is_file()
    assert "static-max" in log and "repl-s" in log  # the table went to stderr with --json


def test_a_draining_replica_finishes_what_it_holds():
    from overlap.engine import SamplingParams

    parser = argparse.ArgumentParser()
    control_replay.add_parser(parser.add_subparsers())
    setup, _ = control_replay.setup_from_args(parser.parse_args(["control", "--trace", "steady", "--no-progress"]))
    finished = []
    start = time.monotonic()
    replica = control_replay.Replica(
        "r",
        setup,
        EngineConfig(max_num_seqs=4, num_buffers=2).live,
        lambda: time.monotonic() - start,
        0.0,
        finished.append,
    )
    try:
        for i in range(12):
            replica.submit(f"q{i}", [11, 12, 13], SamplingParams(max_tokens=4, ignore_eos=True), time.monotonic())
        replica.drain(time.monotonic() - start)
        assert not replica.is_ready(time.monotonic() - start)
        deadline = time.monotonic() + 10
        while replica.stopped is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        replica.close()
    assert replica.stopped is not None and len(finished) == 12 and all(out.finished for out in finished)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--runs", "overlap,bogus"], "unknown run bogus"),
        (["--runs", "static-9"], "static-9 is above --max-replicas 8"),
        (["--start-replicas", "12"], "--start-replicas must be within"),
        (["--ttft-slo-s", "0"], "--ttft-slo-s must be > 0"),
        (["--min-replicas", "0"], "--min-replicas"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
        (["--time-scale", "0"], "--time-scale must be > 0"),
        (["--interval-s", "-1"], "--interval-s must be > 0"),
        (["--slo-s", "nan"], "--slo-s must be > 0"),
        (["--sim-cost", "fast"], "--sim-cost"),
        (["--scale-rate", "-2"], "factor must be > 0"),
        (["--trace", "no-such-trace"], "neither a file nor a built-in trace"),
    ],
)
def test_bad_arguments_get_one_line_errors(extra, message, capsys, tmp_path):
    assert main(["bench", "control", "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_argparse_refuses_non_numbers(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "control", "--max-replicas", "many"])
    assert exc.value.code == 2 and "invalid int value" in capsys.readouterr().err


def test_flaps_are_reversals_within_the_scale_down_window():
    from overlap.bench.control_replay.summary import count_flaps

    moves = [
        {"t": 0.0, "action": "scale-up"},
        {"t": 1.0, "action": "retune"},
        {"t": 2.0, "action": "scale-down"},  # 2 s after the up: a flap within a 5 s window
        {"t": 10.0, "action": "scale-down"},  # same direction: not a reversal
        {"t": 20.0, "action": "scale-up"},  # 10 s after: outside the window
    ]
    assert count_flaps(moves, window_s=5) == 1
    assert count_flaps(moves, window_s=15) == 2


def test_the_verdict_reads_dominance_on_slo_and_cost():
    from overlap.bench.control_replay.summary import verdict

    def run(label, slo, cost, flaps=0.0):
        return {"label": label, "slo_attainment": slo, "replica_seconds": cost, "flaps_per_hour": flaps}

    lines = verdict([run("static-max", 1.0, 100), run("keda-queue", 0.99, 80), run("overlap", 0.995, 70)])
    assert lines == [
        "verdict: SLO 99.5% vs static-max 100.0% (0.5 points behind; bar: at most 1 behind): PASS",
        "verdict: replica-seconds 70.0% of static-max (bar <= 75%): PASS",
        "verdict: 0.00 flaps per trace-hour (bar <= 1): PASS",
        "verdict: dominated by no run on (SLO, replica-seconds): PASS",
    ]
    lines = verdict([run("static-max", 1.0, 100), run("static-6", 0.995, 60), run("overlap", 0.98, 80, flaps=2)])
    assert lines[0].endswith("FAIL") and lines[1].endswith("FAIL") and lines[2].endswith("FAIL")
    assert lines[3] == "verdict: dominated by static-6 on (SLO, replica-seconds): FAIL"
    ahead = verdict([run("static-max", 0.5, 100), run("overlap", 0.9, 60)])[0]
    assert "(40.0 points ahead; bar: at most 1 behind): PASS" in ahead


def test_the_verdict_checks_every_static_fleet_and_says_which_did_not_run():
    from overlap.bench.control_replay.summary import verdict

    def run(label, slo, cost, static=None):
        return {"label": label, "slo_attainment": slo, "replica_seconds": cost, "flaps_per_hour": 0.0,
                "static_replicas": static}  # fmt: skip

    statics = [run(f"static-{n}", 0.80 + 0.05 * n, 10.0 * n, n) for n in (1, 2, 3)]
    assert verdict([*statics, run("overlap", 0.93, 25)], (1, 3))[-1] == (
        "verdict: static fleets of 1..3 replicas dominating it: none: PASS"
    )
    assert verdict([*statics, run("overlap", 0.88, 25)], (1, 3))[-1] == (
        "verdict: static fleets of 1..3 replicas dominating it: static-2: FAIL"  # 0.90 at 20 beats 0.88 at 25
    )
    assert verdict([statics[0], statics[2], run("overlap", 0.93, 25)], (1, 3))[-1] == (
        "verdict: static fleets of 1..3 replicas dominating it: none (not run: static-2; --runs statics runs all): "
        "INCOMPLETE"
    )


def test_runs_statics_expands_to_every_fleet_between_the_bounds():
    parser = argparse.ArgumentParser()
    control_replay.add_parser(parser.add_subparsers())
    args = parser.parse_args(["control", "--trace", "steady", "--runs", "static-2,statics,overlap", "--min-replicas",
                              "1", "--max-replicas", "3", "--no-progress"])  # fmt: skip
    _, names = control_replay.setup_from_args(args)
    assert names == ["static-2", "static-1", "static-3", "overlap"]
    # the default: every fixed fleet and overlap, so the verdict line is complete
    _, names = control_replay.setup_from_args(parser.parse_args(["control", "--trace", "steady", "--no-progress"]))
    assert names == [f"static-{n}" for n in range(1, 9)] + ["overlap"]


def test_the_baselines_follow_their_published_arithmetic():
    from overlap.bench.control_replay.baselines import HpaCpu, KedaQueue, LlmdSlo
    from overlap.operator.control.policy import Signals

    hpa = HpaCpu(time_scale=1, low=1, high=10)
    assert hpa.target(Signals(0, 2, device_busy=0.74), 2)[0] == 2  # 0.74 / 0.7 within the 10% tolerance
    assert hpa.target(Signals(15, 2, device_busy=1.0), 2)[0] == 3  # ceil(2 x 1.0 / 0.7)
    # scale-down waits for the 300 s stabilisation window: the highest recommendation of the window holds
    assert hpa.target(Signals(30, 3, device_busy=0.1), 3)[0] == 3
    assert hpa.target(Signals(340, 3, device_busy=0.1), 3)[0] == 1
    keda = KedaQueue(time_scale=1, low=1, high=10)
    assert keda.target(Signals(0, 2, queue_depth=14), 2)[0] == 3  # ceil(14 / 5)
    assert keda.target(Signals(15, 2, queue_depth=400), 2)[0] == 6  # 80 wanted, at most max(2 x 2, 2 + 4)
    llmd = LlmdSlo(time_scale=1, low=1, high=10, ttft_slo_s=1.0, tpot_slo_s=0.05)
    assert llmd.target(Signals(0, 2, ttft_p90_s=0.8), 2)[0] == 3  # s 0.8 > 0.55: one up
    assert llmd.target(Signals(50, 2, ttft_p90_s=0.8), 4)[0] == 4  # 2 of 4 ready: ask 0.4, between: hold
    assert llmd.target(Signals(100, 4, ttft_p90_s=0.2, itl_p90_s=0.01), 4)[0] == 3  # s 0.2 < 0.4: one down


def test_the_modelled_fleet_agrees_with_the_engines(report, burst_file, tmp_path):
    """`--fleet model` (the engines' batching in simulated time, what the trace sweep runs) against the real engines
    on the same trace and fleets."""
    engines = {run["label"]: run for run in report[0]["runs"]}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        runs = "static-min,static-max,static-2,overlap"
        args = ["--runs", runs, "--start-replicas", "1", "--fleet", "model", "--json", "--out", str(tmp_path)]
        assert main(control_args(burst_file, *args)) == 0
    model = {run["label"]: run for run in json.loads(stdout.getvalue())["runs"]}
    for label in ("static-min", "static-max", "static-2"):
        ours, real = model[label], engines[label]
        print(label, {k: (ours[k], real[k]) for k in ("throughput_rps", "latency_p50_ms", "slo_attainment")})
        assert ours["finished"] == real["finished"] == ours["requests"]
        assert ours["replica_seconds"] == pytest.approx(real["replica_seconds"], rel=0.1)
        assert abs(ours["slo_attainment"] - real["slo_attainment"]) < 0.1
        assert ours["latency_p50_ms"] == pytest.approx(real["latency_p50_ms"], rel=0.35)
    assert model["overlap"]["finished"] == model["overlap"]["requests"]
    assert model["overlap"]["scale_ups"] >= 1 and model["overlap"]["scale_downs"] >= 1
