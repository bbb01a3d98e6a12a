"""`overlap bench control-sweep`: one short trace through the whole path, and the bars' arithmetic. The sweep itself
is a benchmark (docs/control.md), not a test."""

from __future__ import annotations

import pytest

from overlap.bench.control_sweep import judge_trace, plot_family, summarize, verdict_lines
from overlap.cli import main


def test_one_trace_is_judged_against_every_static_fleet(tmp_path):
    result = judge_trace("flash:1", ["--duration-s", "600"])  # the first 10 minutes: 10 s replayed
    assert result["family"] == "flash" and "flash-seed1" in result["description"]
    assert sorted(result["statics"]) == [f"static-{n}" for n in range(1, 9)]
    assert result["static_max_replica_seconds"] == result["statics"]["static-8"][1]
    for label in result["dominated_by"]:
        slo, cost = result["statics"][label]
        assert slo >= result["slo"] and cost <= result["replica_seconds"]
    assert result["closest_static"] in result["timelines"] and "overlap" in result["timelines"]
    # the cheapest static fleet within a point of static-max's SLO
    near_max = {
        label: cost for label, (slo, cost) in result["statics"].items() if slo >= result["static_max_slo"] - 0.01
    }
    assert near_max[result["hindsight_static"]] == min(near_max.values())
    assert result["verdict"][-1].startswith("verdict: static fleets of 1..8 replicas dominating it")
    plot_family([result], tmp_path / "flash.png")
    assert (tmp_path / "flash.png").stat().st_size > 0


def result(slo, cost_share, flaps=0.0, dominated=(), family="pareto"):
    return {
        "trace": f"{family}:1",
        "family": family,
        "slo": slo,
        "static_max_slo": 0.99,
        "static_max_replica_seconds": 480.0,
        "cost_share": cost_share,
        "flaps_per_hour": flaps,
        "dominated_by": list(dominated),
        "statics": {"static-4": [0.985, 240.0], "static-8": [0.99, 480.0]},
        "hindsight_static": "static-4",
    }


def test_the_bars_are_computed_over_the_split():
    good = [result(0.98, 0.7, family=f) for f in ("a", "b", "c", "d", "e")] * 2
    s = summarize(good)
    assert s["traces"] == 10 and s["families"] == 5 and all(s["pass"].values())
    assert s["slo_gap_points"] == pytest.approx(1.0)
    assert s["hindsight_cost_share"] == pytest.approx(0.5) and s["hindsight_slo_gap_points"] == pytest.approx(0.5)
    worse = [*good[:9], result(0.5, 1.0, flaps=1.5, dominated=["static-4"])]
    s = summarize(worse)
    assert s["undominated_share"] == pytest.approx(0.9) and s["pass"]["undominated"]  # 90% is the bar
    assert not s["pass"]["flaps"] and s["traces_over_flap_bar"] == 1
    lines = verdict_lines("test", worse)
    assert "dominated: pareto:1 (static-4)" in lines[1] and lines[2].endswith("over: pareto:1 (1.50)")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--families", "nosuch"], "--families: unknown nosuch"),
        (["--seeds", "0"], "seeds per family"),
        (["--set", "decide.NO_SUCH=1"], "decide has no numeric constant 'NO_SUCH'"),
        (["--set", "policy.X=1"], "MODULE decide, forecast or tuning"),
        (["--set", "decide.BURST_EXCESS=lots"], "'lots' is not a float"),
    ],
)
def test_bad_arguments_get_one_line_errors(extra, message, capsys, tmp_path):
    assert main(["bench", "control-sweep", "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_rule_constant_is_set_for_the_sweep_and_put_back():
    from overlap.bench.control_sweep import override_constants
    from overlap.operator.control import decide, tuning

    before, undo = decide.BURST_EXCESS, []
    try:
        done = override_constants(["decide.BURST_EXCESS=0.3", "tuning.UNDO_AFTER_INTERVALS=5"], undo)
        assert done == {"decide.BURST_EXCESS": 0.3, "tuning.UNDO_AFTER_INTERVALS": 5}
        assert decide.BURST_EXCESS == 0.3 and tuning.UNDO_AFTER_INTERVALS == 5
    finally:
        for module, name, old in reversed(undo):
            setattr(module, name, old)
    assert before == decide.BURST_EXCESS
