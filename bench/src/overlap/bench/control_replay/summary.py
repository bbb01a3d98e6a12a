"""What a run comes to: its figures (`summarize_run`), the comparison table and plot, and the header lines that
describe the setup."""

from __future__ import annotations

import itertools
import math
import textwrap
from pathlib import Path

import numpy as np

from overlap.bench.control_replay.loop import ControlRun
from overlap.bench.control_replay.plan import SIGNAL_WINDOW_S, Setup
from overlap.bench.report import compute_metrics
from overlap.bench.traces import Trace

# A flap: a scale move reversed within 5 minutes (operator time; the HPA's default scale-down stabilisation),
# whatever window the policy itself uses, so that a shorter window cannot hide one.
FLAP_WINDOW_S = 300.0


def count_flaps(decisions: list[dict], window_s: float) -> int:
    """Reversals: a scale move in the opposite direction of the previous one within `window_s` of it."""
    moves = [d for d in decisions if d["action"] in ("scale-up", "scale-down")]
    return sum(b["action"] != a["action"] and b["t"] - a["t"] < window_s for a, b in itertools.pairwise(moves))


def summarize_run(run: ControlRun, setup: Setup) -> dict:
    """One run's figures for the table and the JSON."""
    slo_s = setup.slo_s
    m = compute_metrics(run.result)
    records = run.result.records
    wall = run.result.wall_s
    within = sum(r.status == "finished" and r.e2e is not None and r.e2e <= slo_s for r in records)
    # SLO misses (late, unfinished or refused) per tick, counted at the tick that ends the interval they arrived in
    late = [r.arrived for r in records if not (r.status == "finished" and r.e2e is not None and r.e2e <= slo_s)]
    where = np.minimum(np.searchsorted([k.t for k in run.ticks], late), len(run.ticks) - 1)
    misses = np.bincount(where, minlength=len(run.ticks))
    counts = {
        action: sum(d["action"] == action for d in run.decisions) for action in ("scale-up", "scale-down", "retune")
    }
    return {
        "label": run.result.label,
        "static_replicas": run.static_replicas,
        "requests": m.num_requests,
        "finished": m.num_finished,
        "unfinished": m.num_unfinished,
        "rejected": m.num_rejected + m.num_failed,
        "wall_s": round(wall, 2),
        "throughput_rps": round(m.requests_per_s, 1),
        "latency_mean_ms": _round(m.e2e_mean_ms),
        "latency_p50_ms": _round(m.e2e_p50_ms),
        "latency_p99_ms": _round(m.e2e_p99_ms),
        "ttft_p99_ms": _round(m.ttft_p99_ms),
        "slo_attainment": round(within / max(m.num_requests, 1), 4),
        "replica_seconds": round(run.replica_seconds, 2),
        "mean_replicas": round(run.replica_seconds / max(wall, 1e-9), 2),
        "scale_ups": counts["scale-up"],
        "scale_downs": counts["scale-down"],
        "retunes": counts["retune"],
        "flaps": (flaps := count_flaps(run.decisions, FLAP_WINDOW_S / setup.time_scale)),
        # the trace's hours in operator time (replayed seconds x time scale)
        "flaps_per_hour": round(flaps / max(setup.trace.duration_s * setup.time_scale / 3600, 1e-9), 2),
        "knobs_final": run.final_knobs,
        "host": {
            "submit_lag_ms": {k: round(v, 1) for k, v in run.submit_lag_ms.items()},
            "cpu_share": round(run.cpu_share, 2),
        },
        "decisions": run.decisions,
        "timeline": [
            {
                "t": round(k.t, 3),
                "arrival_rps": round(k.arrival_rate, 1),
                "ready": k.ready,
                "replicas": k.replicas,
                "queue_depth": k.queue_depth,
                "action": k.action,
                "floor": k.floor,
                "forecast_rps": None if k.forecast is None else round(k.forecast, 1),
                "slo_misses": int(missed),
            }
            for k, missed in zip(run.ticks, misses, strict=True)
        ],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


_TABLE = (
    ("run", "label", None),
    ("done", "finished", "d"),
    ("unfin.", "unfinished", "d"),
    ("rej.", "rejected", "d"),
    ("req/s", "throughput_rps", ".1f"),
    ("mean ms", "latency_mean_ms", ".0f"),
    ("P50 ms", "latency_p50_ms", ".0f"),
    ("P99 ms", "latency_p99_ms", ".0f"),
    ("TTFT P99", "ttft_p99_ms", ".0f"),
    ("SLO", "slo_attainment", ".1%"),
    ("replicas", "mean_replicas", ".2f"),
    ("repl-s", "replica_seconds", ".1f"),
    ("ups", "scale_ups", "d"),
    ("downs", "scale_downs", "d"),
    ("retunes", "retunes", "d"),
    ("flaps/h", "flaps_per_hour", ".2f"),
)


def verdict(runs: list[dict], fleets: tuple[int, int] | None = None) -> list[str]:
    """The bar for overlap's run: SLO attainment within 1 point of static-max's at <= 75% of its replica-seconds,
    <= 1 flap per trace-hour, no run better or equal on both SLO and cost (dominance), and, with `fleets` (min, max),
    no static fleet of min..max replicas dominating it (complete only when every one of them ran: `--runs statics`)."""
    by = {run["label"]: run for run in runs}
    ours, top = by.get("overlap"), by.get("static-max")
    if top is None and fleets is not None:  # static-N at the largest fleet is static-max under another name
        top = next((run for run in runs if run.get("static_replicas") == fleets[1]), None)
    if ours is None:
        return []
    lines = []
    if top is not None:
        gap = (top["slo_attainment"] - ours["slo_attainment"]) * 100
        cost = ours["replica_seconds"] / max(top["replica_seconds"], 1e-9)
        standing = f"{gap:.1f} points behind" if gap >= 0 else f"{-gap:.1f} points ahead"
        lines.append(
            f"verdict: SLO {ours['slo_attainment']:.1%} vs {top['label']} {top['slo_attainment']:.1%} "
            f"({standing}; bar: at most 1 behind): {'PASS' if gap <= 1 else 'FAIL'}"
        )
        lines.append(
            f"verdict: replica-seconds {cost:.1%} of {top['label']} (bar <= 75%): {'PASS' if cost <= 0.75 else 'FAIL'}"
        )
    lines.append(
        f"verdict: {ours['flaps_per_hour']:.2f} flaps per trace-hour (bar <= 1): "
        f"{'PASS' if ours['flaps_per_hour'] <= 1 else 'FAIL'}"
    )
    dominating = [
        run["label"]
        for run in runs
        if run is not ours
        and run["slo_attainment"] >= ours["slo_attainment"]
        and run["replica_seconds"] <= ours["replica_seconds"]
        and (run["slo_attainment"], -run["replica_seconds"]) != (ours["slo_attainment"], -ours["replica_seconds"])
    ]
    lines.append(
        f"verdict: dominated by {', '.join(dominating) if dominating else 'no run'} on (SLO, replica-seconds): "
        f"{'FAIL' if dominating else 'PASS'}"
    )
    if fleets is not None:
        sizes = {run["static_replicas"]: run["label"] for run in runs if run.get("static_replicas")}
        missing = [n for n in range(fleets[0], fleets[1] + 1) if n not in sizes]
        by_static = [label for label in dominating if label in sizes.values()]
        outcome = "FAIL" if by_static else ("INCOMPLETE" if missing else "PASS")
        lines.append(
            f"verdict: static fleets of {fleets[0]}..{fleets[1]} replicas dominating it: "
            f"{', '.join(by_static) or 'none'}"
            + (f" (not run: {', '.join(f'static-{n}' for n in missing)}; --runs statics runs all)" if missing else "")
            + f": {outcome}"
        )
    return lines


def table(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = [name for name, _, _ in _TABLE]
    rows = [
        [run[key] if fmt is None else ("-" if run[key] is None else format(run[key], fmt)) for _, key, fmt in _TABLE]
        for run in runs
    ]
    return header, rows


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Arrival rate, replicas and queue depth over time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7, 6.6), dpi=80, sharex=True)
    first = runs[0]["timeline"]
    axes[0].plot([k["t"] for k in first[1:]], [k["arrival_rps"] for k in first[1:]], color="black", lw=0.8)
    axes[0].set_ylabel("arrivals (req/s)")
    for run in sorted(runs, key=lambda r: r["label"] == "overlap"):  # overlap's lines on top, thicker
        t = [k["t"] for k in run["timeline"]]
        wide = 2.0 if run["label"] == "overlap" else 1.0
        axes[1].step(t, [k["replicas"] for k in run["timeline"]], where="post", label=run["label"], lw=wide)
        axes[2].plot(t, [k["queue_depth"] for k in run["timeline"]], label=run["label"], lw=wide * 0.8)
    axes[1].set_ylabel("replicas (asked)")
    axes[2].set_ylabel("waiting requests")
    axes[2].set_yscale("symlog", linthresh=10)
    axes[2].set_xlabel("replayed time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_title(textwrap.fill(title, 110), fontsize=7)
    columns = min(len(runs), 5)
    fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=columns, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.03 * (1 + (len(runs) - 1) // columns), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def peak_rate_rps(trace: Trace, bin_s: float) -> float:
    arrivals = [r.arrival_s for r in trace.requests]
    counts, _ = np.histogram(
        arrivals,
        bins=max(1, math.ceil((trace.duration_s + 1e-9) / bin_s)),
        range=(0, max(bin_s, math.ceil((trace.duration_s + 1e-9) / bin_s) * bin_s)),
    )
    return float(counts.max() / bin_s)


def header_lines(setup: Setup) -> list[str]:
    policy = setup.scaling_policy("builtin")
    k = setup.time_scale
    capacity = setup.replica_capacity_rps()
    peak = peak_rate_rps(setup.trace, SIGNAL_WINDOW_S / k)
    return [
        f"trace {setup.trace.describe()}",
        f"simulated device: a step of N tokens takes {setup.cost_ms_us[0]:g} ms + N x {setup.cost_ms_us[1]:g} us; "
        f"one replica at max_num_seqs {setup.max_num_seqs} serves at most ~{capacity:.0f} req/s of this trace; "
        f"the trace peaks at {peak:.0f} req/s (over {SIGNAL_WINDOW_S / k:g} s) = {peak / capacity:.1f} replicas",
        f"controller time / {k:g}: tick {setup.interval_s:g} s, up window {policy.up_window_s:g} s, down window "
        f"{policy.down_window_s:g} s, cooldowns up {policy.up_cooldown_s:g} s / down {policy.down_cooldown_s:g} s, "
        f"latency signals over {SIGNAL_WINDOW_S / k:g} s; cold start {setup.cold_start_s:g} s; watermarks "
        f"{setup.up_watermark:g} up / {setup.down_watermark:g} down waiting per ready replica; replicas "
        f"{setup.min_replicas}..{setup.max_replicas}; P99 SLO {setup.slo_s:g} s; router: least outstanding requests",
        f"dynamic runs start with {setup.start_replicas} replicas; SLO laws: P90 TTFT {setup.ttft_slo_s:g} s, "
        f"P90 TPOT {setup.tpot_slo_s:g} s; overlap's floor plans {policy.target_utilization:.0%} of the measured "
        f"capacity, cold start assumed {policy.cold_start_s:g} s until seen, load period {setup.period_s:g} s",
        "overlap's offline capacity profile (req/s per replica at max_num_seqs): "
        + ", ".join(f"{b}: {rps:.0f}" for b, rps in setup.capacity_profile().items()),
    ]
