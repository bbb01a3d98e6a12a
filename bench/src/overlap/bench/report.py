"""Metrics, diagnosis and the written report of a replay (field report 2's method).

Every request of a run carries timestamps (seconds from the start of the run): arrived, first scheduled (in-process
only), first token, each token, finished. From them: requests/s, tokens/s, mean/P50/P99 end-to-end latency, time to
first token, inter-token latency, queue-time share; the runner adds device-busy time (in-process) and samples of
queue depth over time. A diagnosis per run follows the three-step rule, and `write_report` writes Markdown + JSON +
PNG plots into one folder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# Diagnosis thresholds (the three-step rule). Named so the report can print them next to its verdicts.
QUEUE_SHARE_LOW = 0.25  # below: requests spend most of their time being computed
QUEUE_SHARE_HIGH = 0.5  # above: requests spend most of their time waiting
DEVICE_BUSY_LOW = 0.5  # below: the device idles while requests wait
BATCH_FILL_LOW = 0.25  # mean batch below this share of the cap while requests wait: the device works at batch ~1
P99_OVER_MEAN_HOL = 2.5  # P99 latency this far above the mean: a few requests wait behind long ones ...
TAIL_WAIT_SHARE_HOL = 0.5  # ... if those slowest requests spent at least this share of their time waiting


@dataclass(slots=True)
class RequestRecord:
    """One request of a run. Times are seconds from the start of the run; None when the event never happened."""

    request_id: str
    arrived: float  # in-process: the trace arrival; target: when the client sent it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    first_scheduled: float | None = None  # in-process only (the engine's RequestTimes)
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token (or stream chunk) arrived
    status: str = "unfinished"  # finished | rejected | failed | unfinished
    detail: str | None = None  # finish reason, HTTP status or error text

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrived


@dataclass(slots=True)
class RunResult:
    """What one replay produced: the records plus what the runner measured around them."""

    label: str  # e.g. "serial", "dynamic(max_batch=8, max_wait_ms=150)", "http://127.0.0.1:8000"
    mode: str  # in-process | target
    config: dict
    records: list[RequestRecord]
    wall_s: float  # from the start of the run to its end (last finish, or the drain deadline)
    submit_end_s: float  # when the last request was submitted
    busy_s: float | None = None  # device busy seconds during the run (in-process)
    max_batch: int | None = None  # the sequence cap, for the batch-fill check
    # (t, waiting, running, busy share since the previous sample); busy is None for targets
    samples: list[tuple[float, int, int, float | None]] = field(default_factory=list)


@dataclass(slots=True)
class Metrics:
    num_requests: int
    num_finished: int
    num_rejected: int
    num_failed: int
    num_unfinished: int
    span_s: float
    requests_per_s: float
    tokens_per_s: float
    e2e_mean_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_mean_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    queue_share: float | None  # sum of queue time / sum of end-to-end time (finished requests)
    device_busy_share: float | None  # busy seconds / wall time of the run
    mean_batch: float | None  # mean number of running requests while any ran (from the samples)
    tail_wait_share: float | None  # slowest 1% of finished requests: share of their time spent waiting


@dataclass(slots=True)
class Diagnosis:
    cause: str  # compute-bound | policy too conservative | head-of-line blocking | saturated | healthy | unknown
    findings: list[str]

    @property
    def summary(self) -> str:
        return self.cause + (f": {self.findings[0]}" if self.findings else "")


def _ms(values: list[float], q: float | None = None) -> float | None:
    if not values:
        return None
    return float(np.mean(values) * 1000) if q is None else float(np.percentile(values, q) * 1000)


def compute_metrics(run: RunResult) -> Metrics:
    """Metrics from the timestamps. Latencies cover finished requests plus unfinished ones at their wait so far;
    inter-token latency and queue share cover finished requests; throughput counts finished requests over the span
    from the start of the run to its last finish (so a backlog left at the drain deadline lowers it)."""
    records = run.records
    done = [r for r in records if r.status == "finished" and r.finished is not None]
    span = max((r.finished for r in done), default=0.0)
    span = max(span, 1e-9)
    # A request still unfinished at the drain deadline counts with the time it had waited by then (a lower bound),
    # so a policy cannot look fast by leaving its slowest requests unfinished.
    unfinished = [r for r in records if r.status == "unfinished"]
    e2e = [r.e2e for r in done] + [max(0.0, run.wall_s - r.arrived) for r in unfinished]
    ttft = [r.first_token - r.arrived for r in done if r.first_token is not None]
    ttft += [max(0.0, run.wall_s - r.arrived) for r in unfinished if r.first_token is None]
    gaps = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    queued = [(r.first_scheduled - r.arrived, r.e2e) for r in done if r.first_scheduled is not None]
    queue_share = (
        sum(q for q, _ in queued) / sum(e for _, e in queued) if queued and sum(e for _, e in queued) > 0 else None
    )
    # busy time accumulates over the whole run (drain included), so it is shared over the run's wall time
    busy = None if run.busy_s is None else min(run.busy_s / max(run.wall_s, 1e-9), 1.0)
    # the batch is the engine's running set; a client only sees requests in flight, so targets have none
    running = [s[2] for s in run.samples if s[2] > 0] if run.mode == "in-process" else []
    # The slowest 1% (at least one): did they wait (queued; for targets, until the first token) or compute?
    slowest = sorted(done, key=lambda r: r.e2e)[-max(1, len(done) // 100) :] if done else []
    waits = [
        (r.first_scheduled if r.first_scheduled is not None else r.first_token) - r.arrived
        for r in slowest
        if (r.first_scheduled if r.first_scheduled is not None else r.first_token) is not None
    ]
    tail_e2e = sum(r.e2e for r in slowest)
    tail_wait_share = sum(waits) / tail_e2e if waits and tail_e2e > 0 else None
    return Metrics(
        num_requests=len(records),
        num_finished=len(done),
        num_rejected=sum(r.status == "rejected" for r in records),
        num_failed=sum(r.status == "failed" for r in records),
        num_unfinished=sum(r.status == "unfinished" for r in records),
        span_s=span,
        requests_per_s=len(done) / span,
        tokens_per_s=sum(r.num_output_tokens for r in done) / span,
        e2e_mean_ms=_ms(e2e),
        e2e_p50_ms=_ms(e2e, 50),
        e2e_p99_ms=_ms(e2e, 99),
        ttft_mean_ms=_ms(ttft),
        ttft_p50_ms=_ms(ttft, 50),
        ttft_p99_ms=_ms(ttft, 99),
        itl_mean_ms=_ms(gaps),
        itl_p50_ms=_ms(gaps, 50),
        itl_p99_ms=_ms(gaps, 99),
        queue_share=queue_share,
        device_busy_share=busy,
        mean_batch=float(np.mean(running)) if running else None,
        tail_wait_share=tail_wait_share,
    )


def diagnose(metrics: Metrics, slo_ms: float, max_batch: int | None = None) -> Diagnosis:
    """The three-step rule, in order: (1) high latency with a low queue share: compute-bound; (2) a high queue
    share with a low device busy share: the policy is too conservative; (3) P99 far above the mean: head-of-line
    blocking.

    On a CPU the runner counts forward time as busy, so a policy that runs batch-1 forwards back to back looks
    "busy" while doing a fraction of the work a full batch would; step 2 therefore also fires when requests mostly
    wait while the mean batch stays under a quarter of the cap (the CPU's stand-in for low GPU utilisation).
    """
    m = metrics
    if m.num_finished == 0 or m.e2e_mean_ms is None:
        return Diagnosis("unknown", ["no request finished"])
    findings: list[str] = []
    high_latency = m.e2e_mean_ms > slo_ms
    qs = m.queue_share
    # Step 1: compute-bound.
    if high_latency and qs is not None and qs < QUEUE_SHARE_LOW:
        findings.append(
            f"mean latency {m.e2e_mean_ms:.0f} ms > SLO {slo_ms:.0f} ms with queue share {qs:.0%} < "
            f"{QUEUE_SHARE_LOW:.0%}: time goes to computing; a faster device, a smaller model or more replicas help, "
            "a different batching policy does not"
        )
        return Diagnosis("compute-bound", findings)
    # Step 2: the policy holds work back.
    if qs is not None and qs > QUEUE_SHARE_HIGH:
        busy = m.device_busy_share
        if busy is not None and busy < DEVICE_BUSY_LOW:
            findings.append(
                f"queue share {qs:.0%} > {QUEUE_SHARE_HIGH:.0%} while the device is busy only {busy:.0%} "
                f"(< {DEVICE_BUSY_LOW:.0%}): requests wait while the device idles; dispatch sooner or in larger batches"
            )
            return Diagnosis("policy too conservative", findings)
        if max_batch and m.mean_batch is not None and m.mean_batch < BATCH_FILL_LOW * max_batch:
            findings.append(
                f"queue share {qs:.0%} > {QUEUE_SHARE_HIGH:.0%} while the mean batch is {m.mean_batch:.1f} of "
                f"{max_batch} (< {BATCH_FILL_LOW:.0%}): the device runs small batches while requests wait; "
                "admit more requests per step"
            )
            return Diagnosis("policy too conservative", findings)
    # Step 3: head-of-line blocking: a tail far above the mean, made of waiting (a tail made of computing is
    # just long requests).
    tail_far = m.e2e_p99_ms is not None and m.e2e_p99_ms > P99_OVER_MEAN_HOL * m.e2e_mean_ms
    if tail_far and m.tail_wait_share is not None and m.tail_wait_share < TAIL_WAIT_SHARE_HOL:
        findings.append(
            f"P99 {m.e2e_p99_ms:.0f} ms is {m.e2e_p99_ms / m.e2e_mean_ms:.1f}x the mean, but the slowest requests "
            f"spent only {m.tail_wait_share:.0%} of their time waiting: long requests, not head-of-line blocking"
        )
    elif tail_far:
        findings.append(
            f"P99 {m.e2e_p99_ms:.0f} ms is {m.e2e_p99_ms / m.e2e_mean_ms:.1f}x the mean {m.e2e_mean_ms:.0f} ms "
            f"(> {P99_OVER_MEAN_HOL:g}x): some requests wait behind long-running ones; let requests join and leave "
            "a batch at each step (continuous batching)"
        )
        return Diagnosis("head-of-line blocking", findings)
    if high_latency:
        share = "unknown" if qs is None else f"{qs:.0%}"
        findings.append(
            f"mean latency {m.e2e_mean_ms:.0f} ms > SLO {slo_ms:.0f} ms, queue share {share}, with the device busy "
            "and batches filled: the offered load exceeds capacity; add replicas or shed load past a watermark"
        )
        return Diagnosis("saturated", findings)
    findings.append(f"mean latency {m.e2e_mean_ms:.0f} ms within the SLO {slo_ms:.0f} ms")
    return Diagnosis("healthy", findings)


# ---------------------------------------------------------------------------------------------------- tables


_COLUMNS = (
    ("run", None),
    ("req/s", "requests_per_s"),
    ("tok/s", "tokens_per_s"),
    ("mean ms", "e2e_mean_ms"),
    ("P50 ms", "e2e_p50_ms"),
    ("P99 ms", "e2e_p99_ms"),
    ("TTFT P50", "ttft_p50_ms"),
    ("TTFT P99", "ttft_p99_ms"),
    ("ITL P50", "itl_p50_ms"),
    ("queue", "queue_share"),
    ("busy", "device_busy_share"),
    ("batch", "mean_batch"),
    ("done", "num_finished"),
    ("unfin.", "num_unfinished"),
    ("rej.", "num_rejected"),
    ("fail", "num_failed"),
)


def _fmt(key: str, value) -> str:
    if value is None:
        return "-"
    if key in ("queue_share", "device_busy_share"):
        return f"{value:.0%}"
    if isinstance(value, int):
        return str(value)
    if key == "mean_batch" or value < 100:
        return f"{value:.1f}"
    return f"{value:.0f}"


def table_rows(runs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table; `runs` are entries of the report JSON."""
    header = [name for name, _ in _COLUMNS]
    rows = []
    for run in runs:
        m = run["metrics"]
        rows.append([run["label"]] + [_fmt(key, m[key]) for _, key in _COLUMNS[1:]])
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def fmt(row):
        return "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


# ---------------------------------------------------------------------------------------------------- the report


def summarize(
    runs: list[RunResult], trace_description: str, slo_ms: float, command: str = "", notes: list[str] | None = None
) -> dict:
    """The report as a JSON-able dict: per run its config, metrics and diagnosis; plus comparisons."""
    entries = []
    for run in runs:
        metrics = compute_metrics(run)
        diagnosis = diagnose(metrics, slo_ms, run.max_batch)
        entries.append(
            {
                "label": run.label,
                "mode": run.mode,
                "config": run.config,
                "wall_s": round(run.wall_s, 3),
                "metrics": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(metrics).items()},
                "diagnosis": {"cause": diagnosis.cause, "findings": diagnosis.findings},
            }
        )
    return {
        "trace": trace_description,
        "slo_ms": slo_ms,
        "command": command,
        "notes": list(notes or []),
        "runs": entries,
        "comparison": compare_policies(entries),
    }


def compare_policies(entries: list[dict]) -> dict:
    """Throughput relative to serial and the orderings the scheduling analysis expects (when those runs exist)."""
    by_policy = {e["config"].get("batching"): e["metrics"] for e in entries if e["mode"] == "in-process"}
    out: dict = {}
    serial = by_policy.get("serial")
    if serial and serial["requests_per_s"] > 0:
        out["throughput_vs_serial"] = {
            p: round(m["requests_per_s"] / serial["requests_per_s"], 2) for p, m in by_policy.items()
        }
    continuous = by_policy.get("continuous")
    if (
        serial
        and continuous
        and serial.get("itl_p50_ms")
        and continuous.get("itl_p50_ms")
        and continuous.get("mean_batch")
    ):
        # What the step costs predict: a serial step yields one token, a continuous step `mean_batch` tokens (an
        # estimate: prefill chunks and the drain move the measured ratio a little either way).
        out["continuous_vs_serial_step_cost_estimate"] = round(
            serial["itl_p50_ms"] * continuous["mean_batch"] / continuous["itl_p50_ms"], 2
        )
    order = [p for p in ("continuous", "dynamic", "fixed_window", "serial") if p in by_policy]
    if len(order) >= 2:
        rps = [by_policy[p]["requests_per_s"] for p in order]
        # continuous >= dynamic (within 2%: the same capacity measured twice), every other step strictly greater
        holds = all(
            a >= b * 0.98 if (hi, lo) == ("continuous", "dynamic") else a > b
            for (hi, a), (lo, b) in zip(
                zip(order, rps, strict=True), zip(order[1:], rps[1:], strict=True), strict=False
            )
        )
        out["throughput_order"] = " > ".join(order)
        out["throughput_order_holds"] = holds
    batching = [p for p in ("continuous", "dynamic", "fixed_window") if p in by_policy and by_policy[p]["e2e_p99_ms"]]
    if "continuous" in batching and len(batching) >= 2:
        best = min(batching, key=lambda p: by_policy[p]["e2e_p99_ms"])
        out["lowest_p99_batching_policy"] = best
        out["continuous_has_lowest_p99"] = best == "continuous"
    return out


def write_report(
    runs: list[RunResult],
    out_dir: str | Path,
    trace_description: str,
    slo_ms: float,
    command: str = "",
    notes: list[str] | None = None,
) -> dict:
    """Write report.md, report.json and the PNG plots into `out_dir`; return the summary dict. `notes` (e.g. how
    the policies' arguments were chosen) are printed under the trace."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(runs, trace_description, slo_ms, command, notes)
    from overlap.bench.report_plots import plot_all  # matplotlib is imported only when a report is written

    plots = plot_all(runs, out_dir, trace_description)
    summary["plots"] = plots
    (out_dir / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "report.md").write_text(render_markdown(summary))
    return summary


def render_markdown(summary: dict) -> str:
    header, rows = table_rows(summary["runs"])
    lines = [
        "# Replay report",
        "",
        f"Trace: {summary['trace']}",
        "",
    ]
    lines += [f"- {note}" for note in summary.get("notes") or []]
    if summary.get("notes"):
        lines.append("")
    if summary.get("command"):
        lines += ["Reproduce:", "", "```", summary["command"], "```", ""]
    lines += [
        markdown_table(header, rows),
        "",
        "Latencies in ms; a request unfinished at the drain deadline counts with its wait so far (a lower bound); "
        "queue = share of end-to-end time spent queued; busy = device-busy share (forward time over the run); "
        "batch = mean running requests while any ran; unfin. = still unfinished at the drain deadline; rej. = "
        "refused (HTTP 429/503, queue timeout); fail = errors.",
        "",
    ]
    comparison = summary.get("comparison") or {}
    if comparison:
        lines += ["## Comparison", ""]
        if "throughput_vs_serial" in comparison:
            ratios = ", ".join(f"{p} {r:g}x" for p, r in comparison["throughput_vs_serial"].items())
            lines.append(f"- Throughput relative to serial: {ratios}")
        if "continuous_vs_serial_step_cost_estimate" in comparison:
            lines.append(
                "- What the step costs predict for continuous over serial (serial ITL x continuous mean batch / "
                f"continuous ITL, medians): {comparison['continuous_vs_serial_step_cost_estimate']:g}x"
            )
        if "throughput_order" in comparison:
            verdict = "holds" if comparison["throughput_order_holds"] else "does NOT hold"
            lines.append(f"- Expected throughput order {comparison['throughput_order']}: {verdict}")
        if "lowest_p99_batching_policy" in comparison:
            lines.append(f"- Lowest P99 among the batching policies: {comparison['lowest_p99_batching_policy']}")
        lines.append("")
    lines += ["## Diagnosis (three-step rule)", ""]
    for run in summary["runs"]:
        d = run["diagnosis"]
        lines.append(f"- **{run['label']}**: {d['cause']}" + (f": {'; '.join(d['findings'])}" if d["findings"] else ""))
    lines += [
        "",
        f"Thresholds: SLO {summary['slo_ms']:g} ms; low queue share < {QUEUE_SHARE_LOW:.0%}; high queue share > "
        f"{QUEUE_SHARE_HIGH:.0%}; low device busy < {DEVICE_BUSY_LOW:.0%} (or mean batch < {BATCH_FILL_LOW:.0%} of "
        f"the cap); head-of-line blocking when P99 > {P99_OVER_MEAN_HOL:g}x mean and the slowest 1% spent >= "
        f"{TAIL_WAIT_SHARE_HOL:.0%} of their time waiting.",
        "",
        "## Run settings",
        "",
    ]
    for run in summary["runs"]:
        lines.append(f"- **{run['label']}** ({run['mode']}, wall {run['wall_s']:.1f} s): `{json.dumps(run['config'])}`")
    plots = summary.get("plots") or {}
    if plots:
        lines += ["", "## Plots", ""]
        for title, name in plots.items():
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    return "\n".join(lines) + "\n"
