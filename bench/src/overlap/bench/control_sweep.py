"""`overlap bench control-sweep`: the control loop judged on many traces it was not tuned on.

For each family of load (overlap.bench.trace_families) and each seed of a split (train 1..n, test 1001..1000+n),
`overlap bench control --trace FAMILY:SEED --runs statics,overlap --fleet model`: every fixed fleet from 1 to 8
replicas and overlap on the modelled fleet, in simulated time, so the figures do not depend on the host's load.
Per split it reports the bars: overlap dominated by no static fleet on >= 90% of the traces, <= 1 flap per
trace-hour on every trace, mean replica-seconds <= 85% of static-max's at a mean SLO attainment within 2 points of
static-max's; per family the same figures, and a plot of replicas over time for overlap and the closest static fleet
(the one whose replica-seconds are nearest overlap's) on the family's first seed. As the bars' reference it reports
what sizing each trace's fleet in hindsight gives: the cheapest static fleet within HINDSIGHT_POINTS of static-max's
SLO on each trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from overlap.bench.report import markdown_table, text_table
from overlap.bench.trace_families import FAMILIES, SPLITS, split_seeds
from overlap.bench.traces import TraceError

DEFAULT_SEEDS = 7  # per family and split: 6 families x 7 = 42 traces a split
BARS = {"undominated_share": 0.90, "flaps_per_hour": 1.0, "cost_share": 0.85, "slo_gap_points": 2.0}
# The reference of the bars: per trace, the cheapest static fleet within this many points of static-max's SLO,
# chosen in hindsight (what sizing each trace's fleet with its whole hour known would give).
HINDSIGHT_POINTS = 1.0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "control-sweep",
        help="the control loop on many generated traces per family, train and test splits (modelled fleet)",
        description=__doc__.splitlines()[0],
        epilog="Each trace is `overlap bench control --trace FAMILY:SEED --runs statics,overlap --fleet model` with "
        "that command's defaults. Bars: " + ", ".join(f"{k} {v:g}" for k, v in BARS.items()),
    )
    parser.add_argument(
        "--split",
        choices=(*SPLITS, "both"),
        default="both",
        help="train: seeds 1..n of each family (where rule constants may be chosen); test: seeds 1001..1000+n "
        "(only reported); both (default): side by side",
    )
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per family and split (%(default)d)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="override a rule constant of overlap.operator.control.{decide,forecast,tuning} for this sweep, e.g. "
        "decide.BURST_EXCESS=0.3: how the constants are chosen on train (repeatable)",
    )
    parser.add_argument("--out", help="report folder (default reports/control-sweep-<UTC time>)")
    parser.set_defaults(func=_run)


def override_constants(assignments: list[str], undo: list | None = None) -> dict[str, float]:
    """Set rule constants (`decide.BURST_EXCESS=0.3`) in the control modules for this process; the rules read them
    at call time. Only an existing numeric constant can be set. `undo` collects (module, name, old value)."""
    import importlib

    done = {}
    for text in assignments:
        target, sep, value = text.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        if not sep or module_name not in ("decide", "forecast", "tuning"):
            raise TraceError(f"--set {text!r}: give MODULE.NAME=VALUE with MODULE decide, forecast or tuning")
        module = importlib.import_module(f"overlap.operator.control.{module_name}")
        old = getattr(module, name, None)
        if not name.isupper() or isinstance(old, bool) or not isinstance(old, int | float):
            raise TraceError(f"--set {text!r}: {module_name} has no numeric constant {name!r}")
        try:
            new = type(old)(float(value)) if isinstance(old, float) else int(value)
        except ValueError:
            raise TraceError(f"--set {text!r}: {value!r} is not a {type(old).__name__}") from None
        if undo is not None:
            undo.append((module, name, old))
        setattr(module, name, new)
        done[target.strip()] = new
    return done


def judge_trace(name: str, control_args: list[str] = ()) -> dict:
    """One trace: every static fleet and overlap on the modelled fleet; overlap's figures against them."""
    from overlap.bench import control_replay
    from overlap.bench.control_replay.summary import verdict

    parser = argparse.ArgumentParser()
    control_replay.add_parser(parser.add_subparsers())
    args = parser.parse_args(["control", "--trace", name, "--fleet", "model", "--no-progress", *control_args])
    setup, names = control_replay.setup_from_args(args)
    report = control_replay.compare(setup, names, "model")
    runs = {run["label"]: run for run in report["runs"]}
    ours = runs["overlap"]
    statics = sorted((run for run in report["runs"] if run["static_replicas"]), key=lambda r: r["static_replicas"])
    top = statics[-1]
    dominating = [
        run["label"]
        for run in statics
        if run["slo_attainment"] >= ours["slo_attainment"]
        and run["replica_seconds"] <= ours["replica_seconds"]
        and (run["slo_attainment"], run["replica_seconds"]) != (ours["slo_attainment"], ours["replica_seconds"])
    ]
    closest = min(statics, key=lambda run: abs(run["replica_seconds"] - ours["replica_seconds"]))
    hindsight = min(
        (run for run in statics if run["slo_attainment"] >= top["slo_attainment"] - HINDSIGHT_POINTS / 100),
        key=lambda run: run["replica_seconds"],
    )
    return {
        "trace": name,
        "family": name.partition(":")[0],
        "description": report["trace"],
        "slo": ours["slo_attainment"],
        "replica_seconds": ours["replica_seconds"],
        "flaps_per_hour": ours["flaps_per_hour"],
        "static_max_slo": top["slo_attainment"],
        "static_max_replica_seconds": top["replica_seconds"],
        "cost_share": ours["replica_seconds"] / max(top["replica_seconds"], 1e-9),
        "dominated_by": dominating,
        "statics": {run["label"]: [run["slo_attainment"], run["replica_seconds"]] for run in statics},
        "closest_static": closest["label"],
        "hindsight_static": hindsight["label"],
        "verdict": verdict(report["runs"], (setup.min_replicas, setup.max_replicas)),
        "timelines": {
            label: [(k["t"], k["arrival_rps"], k["replicas"]) for k in runs[label]["timeline"]]
            for label in ("overlap", closest["label"])
        },
    }


def summarize(results: list[dict]) -> dict:
    """The bars' figures over a set of traces."""
    n = len(results)
    undominated = sum(not r["dominated_by"] for r in results) / max(n, 1)
    flaps = max((r["flaps_per_hour"] for r in results), default=0.0)
    cost = float(np.mean([r["cost_share"] for r in results])) if results else 0.0
    slo = float(np.mean([r["slo"] for r in results])) if results else 0.0
    top = float(np.mean([r["static_max_slo"] for r in results])) if results else 0.0
    gap = (top - slo) * 100
    hindsight = [(r["statics"][r["hindsight_static"]], r) for r in results]  # ((SLO, replica-s), trace)
    hindsight_cost = float(np.mean([c / r["static_max_replica_seconds"] for (_, c), r in hindsight])) if results else 0
    hindsight_gap = float(np.mean([(r["static_max_slo"] - s) * 100 for (s, _), r in hindsight])) if results else 0
    return {
        "traces": n,
        "families": len({r["family"] for r in results}),
        "undominated_share": undominated,
        "max_flaps_per_hour": flaps,
        "traces_over_flap_bar": sum(r["flaps_per_hour"] > BARS["flaps_per_hour"] for r in results),
        "mean_cost_share": cost,
        "mean_slo": slo,
        "mean_static_max_slo": top,
        "slo_gap_points": gap,
        "hindsight_cost_share": hindsight_cost,
        "hindsight_slo_gap_points": hindsight_gap,
        "pass": {
            "undominated": undominated >= BARS["undominated_share"],
            "flaps": flaps <= BARS["flaps_per_hour"],
            "cost": cost <= BARS["cost_share"],
            "slo": gap <= BARS["slo_gap_points"],
        },
    }


def summary_table(by_split: dict[str, list[dict]], families: list[str]) -> tuple[list[str], list[list[str]]]:
    header = ["split", "traces", "not dominated", "max flaps/h", "repl-s / static-max", "SLO", "static-max SLO",
              "hindsight static: repl-s, SLO gap"]  # fmt: skip
    rows = []
    for split, results in by_split.items():
        for family in [None, *families]:
            chosen = [r for r in results if family is None or r["family"] == family]
            if not chosen:
                continue
            s = summarize(chosen)
            rows.append(
                [
                    split if family is None else f"  {family}",
                    str(s["traces"]),
                    f"{s['undominated_share']:.0%}",
                    f"{s['max_flaps_per_hour']:.2f}",
                    f"{s['mean_cost_share']:.1%}",
                    f"{s['mean_slo']:.1%}",
                    f"{s['mean_static_max_slo']:.1%}",
                    f"{s['hindsight_cost_share']:.1%}, {s['hindsight_slo_gap_points']:.1f}",
                ]
            )
    return header, rows


def verdict_lines(split: str, results: list[dict]) -> list[str]:
    s = summarize(results)
    ok = {k: "PASS" if v else "FAIL" for k, v in s["pass"].items()}
    dominated = [f"{r['trace']} ({', '.join(r['dominated_by'])})" for r in results if r["dominated_by"]]
    flapping = [f"{r['trace']} ({r['flaps_per_hour']:.2f})" for r in results if r["flaps_per_hour"] > 1]
    return [
        f"{split}: {s['traces']} traces, {s['families']} families",
        f"{split}: dominated by no static fleet on {s['undominated_share']:.0%} (bar >= 90%): {ok['undominated']}"
        + (f"; dominated: {', '.join(dominated)}" if dominated else ""),
        f"{split}: at most {s['max_flaps_per_hour']:.2f} flaps per trace-hour (bar <= 1 on every trace): "
        f"{ok['flaps']}" + (f"; over: {', '.join(flapping)}" if flapping else ""),
        f"{split}: mean replica-seconds {s['mean_cost_share']:.1%} of static-max's (bar <= 85%): {ok['cost']}",
        f"{split}: mean SLO {s['mean_slo']:.1%} vs static-max {s['mean_static_max_slo']:.1%} "
        f"({s['slo_gap_points']:.1f} points behind; bar <= 2): {ok['slo']}",
        f"{split}: for reference, the cheapest static fleet within {HINDSIGHT_POINTS:g} point of static-max's SLO "
        f"on each trace, chosen in hindsight: {s['hindsight_cost_share']:.1%} of static-max's replica-seconds, "
        f"{s['hindsight_slo_gap_points']:.1f} points behind",
    ]


def plot_family(results: list[dict], path: Path) -> None:
    """Arrival rate and replicas over time for overlap and the closest static fleet, on the family's first seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0]
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.4), dpi=80, sharex=True)
    ours = first["timelines"]["overlap"]
    axes[0].plot([k[0] for k in ours[1:]], [k[1] for k in ours[1:]], color="black", lw=0.8)
    axes[0].set_ylabel("arrivals (req/s)")
    for label, timeline in first["timelines"].items():
        slo, cost = (first["slo"], first["replica_seconds"]) if label == "overlap" else first["statics"][label]
        wide = 2.0 if label == "overlap" else 1.2
        axes[1].step(
            [k[0] for k in timeline],
            [k[2] for k in timeline],
            where="post",
            lw=wide,
            label=f"{label}: SLO {slo:.1%}, {cost:.0f} replica-s",
        )
    axes[1].set_ylabel("replicas (asked)")
    axes[1].set_xlabel("replayed time (s)")
    axes[1].legend(fontsize=7, loc="upper left")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_title(first["description"][:120], fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep(splits: list[str], families: list[str], seeds: int, say=print) -> dict[str, list[dict]]:
    names = [(split, f"{f}:{seed}") for split in splits for f in families for seed in split_seeds(split, seeds)]
    by_split: dict[str, list[dict]] = {split: [] for split in splits}
    started = time.monotonic()
    for i, (split, name) in enumerate(names, 1):
        result = judge_trace(name)
        by_split[split].append(result)
        say(
            f"[{i}/{len(names)}] {split} {name}: overlap {result['slo']:.1%} at {result['replica_seconds']:.0f} "
            f"replica-s ({result['cost_share']:.0%} of static-max's, {result['static_max_slo']:.1%}), "
            f"{result['flaps_per_hour']:.2f} flaps/h, dominated by {', '.join(result['dominated_by']) or 'none'} "
            f"({time.monotonic() - started:.0f} s)"
        )
    return by_split


def _run(args: argparse.Namespace) -> int:
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise TraceError(f"--families: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(FAMILIES)}")
    split_seeds("train", args.seeds)  # checks the count
    undo: list = []
    try:
        return _sweep_and_report(args, families, override_constants(args.set, undo))
    finally:
        for module, name, old in reversed(undo):
            setattr(module, name, old)


def _sweep_and_report(args: argparse.Namespace, families: list[str], overrides: dict[str, float]) -> int:
    splits = list(SPLITS) if args.split == "both" else [args.split]
    out = Path(args.out or f"reports/control-sweep-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TraceError(f"--out {out}: {exc.strerror}") from None
    started = time.monotonic()
    by_split = sweep(splits, families, args.seeds, say=lambda line: print(line, flush=True))
    header, rows = summary_table(by_split, families)
    lines = [line for split, results in by_split.items() for line in verdict_lines(split, results)]
    for split, results in by_split.items():
        for family in families:
            plot_family([r for r in results if r["family"] == family], out / f"{split}-{family}.png")
    report = {
        "overrides": overrides,
        "splits": {split: summarize(results) for split, results in by_split.items()},
        "traces": {
            split: [{k: v for k, v in r.items() if k != "timelines"} for r in rs] for split, rs in by_split.items()
        },
        "wall_s": round(time.monotonic() - started, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plots = [f"![{split} {family}]({split}-{family}.png)" for split in by_split for family in families]
    changed = [f"constants set: {', '.join(f'{k}={v:g}' for k, v in overrides.items())}"] if overrides else []
    (out / "report.md").write_text(
        "\n".join(["# Control sweep", "", *changed, "", markdown_table(header, rows), "", *lines, "", *plots, ""])
    )
    for line in changed:
        print(line)
    print("\n" + text_table(header, rows))
    for line in lines:
        print(line)
    print(f"report: {out}/report.md, plots {out}/<split>-<family>.png (wall {report['wall_s']:.0f} s)", file=sys.stdout)
    return 0
