"""Metrics from hand-built timestamps, the three-step diagnosis on synthetic runs, and the written report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from overlap.bench.report import (
    RequestRecord,
    RunResult,
    compare_policies,
    compute_metrics,
    diagnose,
    write_report,
)


def record(i, arrived, scheduled, first_token, finished, tokens, status="finished"):
    return RequestRecord(
        request_id=str(i),
        arrived=arrived,
        num_prompt_tokens=8,
        num_output_tokens=len(tokens),
        first_scheduled=scheduled,
        first_token=first_token,
        finished=finished,
        token_times=list(tokens),
        status=status,
    )


def run_of(records, busy_s=None, samples=(), label="run", max_batch=None, policy=None):
    return RunResult(
        label=label,
        mode="in-process",
        config={"batching": policy or label},
        records=list(records),
        wall_s=max((r.finished or 0) for r in records),
        submit_end_s=max(r.arrived for r in records),
        busy_s=busy_s,
        samples=list(samples),
        max_batch=max_batch,
    )


def test_metrics_from_hand_built_timestamps():
    records = [
        # queue 0.1 s, first token at 0.3, tokens at 0.3 / 0.4 / 0.6, finished 0.6 (e2e 0.6)
        record("a", 0.0, 0.1, 0.3, 0.6, [0.3, 0.4, 0.6]),
        # queue 0.5 s, e2e 1.0, tokens at 1.2 / 1.5
        record("b", 0.5, 1.0, 1.2, 1.5, [1.2, 1.5]),
        # queue 0, e2e 1.0 (finished last, at 2.0)
        record("c", 1.0, 1.0, 1.5, 2.0, [1.5, 1.7, 1.8, 2.0]),
        RequestRecord("d", 1.8, status="unfinished"),
        RequestRecord("e", 1.9, status="rejected", detail="429"),
    ]
    m = compute_metrics(run_of(records, busy_s=1.5, samples=[(0.5, 1, 1, 0.5), (1.0, 2, 0, 0.0), (1.5, 0, 3, 1.0)]))
    assert (m.num_requests, m.num_finished, m.num_unfinished, m.num_rejected) == (5, 3, 1, 1)
    assert m.span_s == pytest.approx(2.0)
    assert m.requests_per_s == pytest.approx(3 / 2.0)
    assert m.tokens_per_s == pytest.approx(9 / 2.0)
    # "d" is unfinished at the end of the run (2.0 s): it counts with its 0.2 s wait so far
    assert m.e2e_mean_ms == pytest.approx((600 + 1000 + 1000 + 200) / 4)
    assert m.e2e_p50_ms == pytest.approx(800)
    assert m.e2e_p99_ms == pytest.approx(np.percentile([600, 1000, 1000, 200], 99))
    assert m.ttft_mean_ms == pytest.approx((300 + 700 + 500 + 200) / 4)
    gaps = [100, 200, 300, 200, 100, 200]
    assert m.itl_mean_ms == pytest.approx(np.mean(gaps))
    assert m.itl_p50_ms == pytest.approx(200)
    assert m.queue_share == pytest.approx((0.1 + 0.5 + 0.0) / (0.6 + 1.0 + 1.0))
    assert m.device_busy_share == pytest.approx(1.5 / 2.0)
    assert m.mean_batch == pytest.approx(2.0)  # samples with something running: 1 and 3


def test_metrics_without_finished_requests_do_not_crash():
    m = compute_metrics(run_of([RequestRecord("x", 0.0, status="unfinished", finished=None)]))
    assert m.num_finished == 0 and m.requests_per_s == 0 and m.itl_mean_ms is None
    assert diagnose(m, slo_ms=100).cause == "unknown"


def synthetic_compute_bound():
    # every request is scheduled at once and then computes for 3 s: latency far above the SLO, little queueing
    recs = [record(i, i * 1.0, i * 1.0 + 0.05, i * 1.0 + 0.5, i * 1.0 + 3.0, [i + 0.5, i + 3.0]) for i in range(20)]
    return run_of(recs, busy_s=20.0, max_batch=8)


def synthetic_too_conservative():
    # requests wait 2 s for a batch to form, then compute for 0.5 s; the device is idle most of the time
    recs = [record(i, i * 1.0, i * 1.0 + 2.0, i * 1.0 + 2.2, i * 1.0 + 2.5, [i + 2.2, i + 2.5]) for i in range(20)]
    return run_of(recs, busy_s=5.0, max_batch=8)


def synthetic_head_of_line():
    # most requests take 0.1 s; two stuck behind a long batch wait 5 s: P99 far above the mean, latency within SLO
    recs = [record(i, i * 0.2, i * 0.2 + 0.01, i * 0.2 + 0.05, i * 0.2 + 0.1, [i * 0.2 + 0.05]) for i in range(98)]
    recs += [record(98 + j, 20.0 + j, 24.9 + j, 24.95 + j, 25.0 + j, [24.95 + j]) for j in range(2)]
    return run_of(recs, busy_s=20.0, max_batch=8)


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (synthetic_compute_bound, "compute-bound"),
        (synthetic_too_conservative, "policy too conservative"),
        (synthetic_head_of_line, "head-of-line blocking"),
    ],
)
def test_diagnosis_names_the_cause(make, cause):
    run = make()
    diagnosis = diagnose(compute_metrics(run), slo_ms=1000, max_batch=run.max_batch)
    assert diagnosis.cause == cause
    assert diagnosis.findings


def test_busy_cpu_running_batch_one_while_requests_queue_is_too_conservative():
    # serial on a CPU: forward time keeps the device "busy", but one request at a time while a queue builds
    recs = [record(i, i * 0.1, i * 0.3, i * 0.3 + 0.01, i * 0.3 + 0.3, [i * 0.3 + 0.3]) for i in range(1, 30)]
    samples = [(t * 0.5, 10, 1, 0.95) for t in range(20)]
    run = run_of(recs, busy_s=8.5, samples=samples, max_batch=64)
    assert diagnose(compute_metrics(run), slo_ms=500, max_batch=64).cause == "policy too conservative"
    # the same run with full batches is simply saturated
    run.samples = [(t * 0.5, 10, 60, 0.95) for t in range(20)]
    assert diagnose(compute_metrics(run), slo_ms=500, max_batch=64).cause == "saturated"


def test_a_tail_of_long_requests_is_not_head_of_line_blocking():
    # 98 short requests and 2 that decode for 5 s without waiting: P99 far above the mean, but nobody queued
    recs = [record(i, i * 0.2, i * 0.2, i * 0.2 + 0.05, i * 0.2 + 0.1, [i * 0.2 + 0.05]) for i in range(98)]
    recs += [record(98 + j, 20.0 + j, 20.0 + j, 20.05 + j, 25.0 + j, [20.05 + j]) for j in range(2)]
    m = compute_metrics(run_of(recs, busy_s=20.0))
    assert m.e2e_p99_ms > 2.5 * m.e2e_mean_ms and m.tail_wait_share < 0.05
    diagnosis = diagnose(m, slo_ms=1000)
    assert diagnosis.cause == "healthy"
    assert "long requests, not head-of-line blocking" in diagnosis.findings[0]


def test_healthy_run():
    recs = [record(i, i * 1.0, i * 1.0, i * 1.0 + 0.05, i * 1.0 + 0.1, [i + 0.05, i + 0.1]) for i in range(10)]
    assert diagnose(compute_metrics(run_of(recs, busy_s=1.0)), slo_ms=1000).cause == "healthy"


def test_policy_comparison_orders_and_ratios():
    def entry(policy, rps, p99, itl=None, batch=None):
        metrics = {"requests_per_s": rps, "e2e_p99_ms": p99, "itl_p50_ms": itl, "mean_batch": batch}
        return {"mode": "in-process", "config": {"batching": policy}, "metrics": metrics}

    entries = [
        entry("serial", 2, 9000, itl=20),
        entry("fixed_window", 8, 4000),
        entry("dynamic", 30, 1500),
        entry("continuous", 40, 900, itl=100, batch=50),
    ]
    out = compare_policies(entries)
    assert out["throughput_vs_serial"]["continuous"] == 20
    assert out["throughput_order_holds"] is True
    assert out["continuous_has_lowest_p99"] is True
    assert out["continuous_vs_serial_step_cost_estimate"] == 10  # 20 ms x 50 / 100 ms
    entries[1] = entry("fixed_window", 35, 4000)  # fixed window beating dynamic breaks the order
    assert compare_policies(entries)["throughput_order_holds"] is False


def test_write_report_makes_markdown_json_and_pngs(tmp_path):
    runs = [synthetic_compute_bound(), synthetic_head_of_line()]
    runs[0].label, runs[1].label = "serial", "continuous"
    runs[0].samples = [(t, 3, 1, 0.9) for t in range(5)]
    note = "dynamic arguments from the advisor: max_batch = floor(7.80) = 7"
    summary = write_report(
        runs, tmp_path, "synthetic trace; transforms: none", slo_ms=1000, command="overlap x", notes=[note]
    )
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.count("| serial |") == 1
    assert f"- {note}" in markdown  # how the arguments were chosen, next to the trace
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["notes"] == [note]
    assert data["runs"][0]["diagnosis"]["cause"] == "compute-bound"
    for name in summary["plots"].values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(summary["plots"]) == 4  # CDF, timeline, one stage breakdown per run
