"""`overlap bench control`: the operator's control loop, closed, on a trace replayed against simulated replicas.

The command: its flags, the checks on them, and the comparison of runs it reports (table, plot, JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from overlap.bench.control_replay.loop import prepare_requests, run_control
from overlap.bench.control_replay.model_fleet import prepare_lengths, run_modelled
from overlap.bench.control_replay.plan import (
    AZURE_SCALE_RATE,
    AZURE_SCALE_TOKENS,
    CRD_SCALING,
    DEFAULT_COLD_START_S,
    DEFAULT_DRAIN_S,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MIN_REPLICAS,
    DEFAULT_RUNS,
    DEFAULT_SIM_COST,
    DEFAULT_SLO_S,
    DEFAULT_TIME_SCALE,
    DEFAULT_TPOT_SLO_S,
    DEFAULT_TRACE,
    DEFAULT_TTFT_SLO_S,
    QUICK_DRAIN_S,
    QUICK_RUNS,
    RUNS,
    SIGNAL_WINDOW_S,
    START_UTILIZATION,
    START_WINDOWS,
    TRACE_PERIODS_S,
    TUNING_BOUNDS,
    Setup,
    static_size,
)
from overlap.bench.control_replay.summary import (
    header_lines,
    plot,
    summarize_run,
    table,
    verdict,
)
from overlap.bench.report import markdown_table, text_table
from overlap.bench.trace_families import FAMILIES, is_family_trace
from overlap.bench.traces import TraceError, is_azure_csv, truncate
from overlap.bench.workload import QUICK_TRACE_S, add_transform_arguments, load_for_args, parse_sim_cost


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "control",
        help="replay a trace against simulated replicas driven by the operator's control loop (scaling, tuning)",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"azure defaults (the Azure hour, FAMILY:SEED and any CSV in the Azure schema): --scale-rate "
        f"{AZURE_SCALE_RATE:g} --scale-tokens {AZURE_SCALE_TOKENS:g} (other traces: 1 and 1). Runs: static-min, "
        "static-max and static-N hold min/max/N replicas; watermark "
        "is decide() on the queue watermark alone; hpa-cpu, keda-queue and llm-slo are the baselines "
        "(control_replay/baselines.py); overlap is decide() with the predictive floor, the SLO law and tuning "
        f"of {', '.join(TUNING_BOUNDS)} within {TUNING_BOUNDS}.",
    )
    parser.add_argument(
        "--trace",
        default=DEFAULT_TRACE,
        help="azure | diurnal | steady | bursty | bursty_2x | FAMILY:SEED, a generated hour of one family of load "
        f"({', '.join(FAMILIES)}; bench/src/overlap/bench/traces/README.md) | a .jsonl/.csv file (a CSV in the "
        "Azure trace's schema, TIMESTAMP,ContextTokens,GeneratedTokens, is read as one)",
    )
    parser.add_argument(
        "--runs",
        help=f"comma-separated runs from {', '.join(RUNS)}, static-N, statics (static-N for every N from "
        f"--min-replicas to --max-replicas) (default {','.join(DEFAULT_RUNS)}; quick {','.join(QUICK_RUNS)})",
    )
    parser.add_argument(
        "--start-replicas",
        type=int,
        help=f"the dynamic runs' first fleet (default: what serves the mean rate of the trace's first {START_WINDOWS} "
        f"signal windows at {START_UTILIZATION * 100:.0f}%% of a replica's capacity, the fleet a controller running "
        "before the trace holds)",
    )
    parser.add_argument(
        "--ttft-slo-s", type=float, default=DEFAULT_TTFT_SLO_S, help="P90 TTFT objective of the SLO laws"
    )
    parser.add_argument(
        "--tpot-slo-s", type=float, default=DEFAULT_TPOT_SLO_S, help="P90 time-per-output-token objective"
    )
    parser.add_argument(
        "--period-s", type=float, help="the load profile's period, replayed seconds (default: the trace's, or a day)"
    )
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
    parser.add_argument(
        "--fleet",
        choices=("engines", "model"),
        default="engines",
        help="engines: each replica a real Engine on the simulated device, in real time (default); model: the "
        "engines' batching as a model in simulated time (control_replay/model_fleet.py), seconds a run",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for prompt token ids")
    parser.add_argument("--json", action="store_true", help="print the report JSON on stdout (the rest on stderr)")
    parser.add_argument("--out", help="report folder (default reports/control-<UTC time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    add_transform_arguments(parser)
    parser.set_defaults(func=_run, scale_rate=None, scale_tokens=None)


def setup_from_args(args: argparse.Namespace, log=sys.stdout) -> tuple[Setup, list[str]]:
    """Check the arguments (TraceError with one line for anything wrong) and build the shared setup."""
    if args.min_replicas < 1 or args.max_replicas < args.min_replicas:
        raise TraceError(f"need 1 <= --min-replicas <= --max-replicas, got {args.min_replicas} and {args.max_replicas}")
    given = args.runs if args.runs is not None else ",".join(QUICK_RUNS if args.quick else DEFAULT_RUNS)
    names = [n.strip() for n in given.split(",") if n.strip()]
    if "statics" in names:  # every fixed fleet from --min-replicas to --max-replicas: what the verdict compares with
        at = names.index("statics")
        fleets = [f"static-{n}" for n in range(args.min_replicas, args.max_replicas + 1)]
        names[at : at + 1] = [f for f in fleets if f not in names]
    unknown = [n for n in names if n not in RUNS and not _is_static(n)]
    if unknown or not names:
        raise TraceError(
            f"--runs: unknown run {', '.join(unknown) or '(none given)'}; choose from {', '.join(RUNS)}, static-N"
        )
    for flag in ("time_scale", "slo_s", "up_watermark", "max_num_seqs", "ttft_slo_s", "tpot_slo_s"):
        if not getattr(args, flag) > 0:
            raise TraceError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    for flag in ("cold_start_s", "down_watermark"):
        if not getattr(args, flag) >= 0:
            raise TraceError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.interval_s is not None and not args.interval_s > 0:
        raise TraceError(f"--interval-s must be > 0, got {args.interval_s}")
    if args.start_replicas is not None and not args.min_replicas <= args.start_replicas <= args.max_replicas:
        raise TraceError(f"--start-replicas must be within --min-replicas..--max-replicas, got {args.start_replicas}")
    if args.period_s is not None and not args.period_s > 0:
        raise TraceError(f"--period-s must be > 0, got {args.period_s}")
    if args.drain_s is not None and not args.drain_s >= 0:
        raise TraceError(f"--drain-s must be >= 0, got {args.drain_s}")
    # the Azure hour, the generated families and any trace in its CSV schema (raw production time and tokens)
    azure = args.trace == "azure" or is_family_trace(args.trace) or is_azure_csv(args.trace)
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
        cost_ms_us=parse_sim_cost(args.sim_cost) or DEFAULT_SIM_COST,
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
        ttft_slo_s=args.ttft_slo_s,
        tpot_slo_s=args.tpot_slo_s,
        period_s=args.period_s or TRACE_PERIODS_S.get(args.trace, 86400.0 / args.time_scale),
        seed=args.seed,
        progress=not args.no_progress,
        log=log,
    )
    if args.start_replicas is not None:
        setup.start_replicas = args.start_replicas
    else:
        window_s = SIGNAL_WINDOW_S / args.time_scale
        first = len(truncate(trace, duration_s=START_WINDOWS * window_s).requests) / (START_WINDOWS * window_s)
        wanted = math.ceil(first / (setup.replica_capacity_rps() * START_UTILIZATION))
        setup.start_replicas = min(max(wanted, args.min_replicas), args.max_replicas)
    too_big = [n for n in names if _is_static(n) and static_size(n) > args.max_replicas]
    if too_big:
        raise TraceError(f"--runs: {', '.join(too_big)} is above --max-replicas {args.max_replicas}")
    return setup, names


def _is_static(name: str) -> bool:
    try:
        static_size(name)
    except ValueError:
        return False
    return True


def compare(setup: Setup, names: list[str], fleet: str = "engines") -> dict:
    """Run each plan on the same trace, on real engines or the modelled fleet; the report as a JSON-able dict."""
    if fleet == "model":
        prepared, replay = prepare_lengths(setup.trace, setup.seed), run_modelled
    else:
        prepared, replay = prepare_requests(setup.trace, setup.seed), run_control
    runs = []
    for plan in setup.plans(names):
        setup.say(
            f"run {plan.label}: {plan.initial_replicas} replicas, controller {plan.controller}, "
            f"tuning {'on' if plan.tune else 'off'}",
        )
        run = replay(setup, plan, prepared)
        summary = summarize_run(run, setup)
        runs.append(summary)
        setup.say(
            f"run {plan.label}: {summary['finished']}/{summary['requests']} finished in {summary['wall_s']:.1f} s, "
            f"{summary['unfinished']} unfinished, {summary['rejected']} rejected; router lag P99 "
            f"{summary['host']['submit_lag_ms']['p99']:.1f} ms, process CPU {summary['host']['cpu_share']:.2f} cores",
        )
    return {
        "trace": setup.trace.describe(),
        "header": header_lines(setup),
        "setup": {
            "sim_cost": {"fixed_ms": setup.cost_ms_us[0], "per_token_us": setup.cost_ms_us[1]},
            "replica_capacity_rps": round(setup.replica_capacity_rps(), 1),
            "capacity_profile_rps": {str(b): round(rps, 1) for b, rps in setup.capacity_profile().items()},
            "time_scale": setup.time_scale,
            "interval_s": setup.interval_s,
            "cold_start_s": setup.cold_start_s,
            "slo_s": setup.slo_s,
            "drain_s": setup.drain_s,
            "start_replicas": setup.start_replicas,
            "ttft_slo_s": setup.ttft_slo_s,
            "tpot_slo_s": setup.tpot_slo_s,
            "period_s": setup.period_s,
            "scaling": dataclasses.asdict(setup.scaling_policy("builtin", predictive=True, slo_law=True)),
            "tuning_bounds": TUNING_BOUNDS,
            "router": "least outstanding requests over ready replicas",
        },
        "fleet": fleet,
        "runs": runs,
        "verdict": verdict(runs, (setup.min_replicas, setup.max_replicas)),
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
    report = compare(setup, names, args.fleet)
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
                *report["verdict"],
                "",
                "![control](control.png)",
                "",
            ]
        )
    )
    print("\n" + text_table(header, rows), file=log)
    for line in report["verdict"]:
        print(line, file=log)
    print(f"report: {out_dir}/report.md, plot {out_dir}/control.png (wall {report['wall_s']:.1f} s)", file=log)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0
