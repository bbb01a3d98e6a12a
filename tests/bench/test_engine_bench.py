"""`overlap bench engine` end to end on a tiny workload (a few seconds): every section of its JSON is there and
consistent with the workload; sizes below 1 are refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _overlap(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "engine", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_tiny_run_reports_every_section(tiny_model_dir):
    result = _overlap("--quick", "--batch-sizes", "2,4", "--num-requests", "4", "--prompt-len", "8",
                      "--output-len", "4", "--model", str(tiny_model_dir), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["setup"]["batch_sizes"] == [2, 4] and report["setup"]["num_requests"] == 4
    assert [row["batch"] for row in report["rows"]] == [2, 4]
    for row in report["rows"]:
        assert row["decode_ceiling_tok_s"] > 0 and row["workload_ceiling_tok_s"] > 0 and row["engine_tok_s"] > 0
        # 4 requests x 4 tokens in waves of `batch`: one step per output token per wave, at least
        assert row["engine_steps"] >= 4 * 4 // row["batch"]
        assert row["engine_over_ceiling"] == pytest.approx(row["engine_tok_s"] / row["workload_ceiling_tok_s"])
        assert 0 < row["engine_busy"] <= 1 and row["sched_ms_per_step"] > 0
    paged = report["paged_vs_contiguous"][0]
    assert paged["batch"] == 4 and paged["contiguous_ms"] > 0 and paged["paged_scattered_ms"] > 0
    assert paged["paged_runs_overhead"] == pytest.approx(paged["paged_runs_ms"] / paged["contiguous_ms"] - 1)
    assert 0 < report["startup"]["fresh_import_and_init_s"] < report["startup"]["fresh_process_s"]
    assert "over_fp32" not in paged  # fp32 is compared with itself only at another dtype


def test_bf16_run_reports_its_step_against_fp32_side_by_side(tiny_model_dir):
    result = _overlap("--quick", "--batch-sizes", "4", "--num-requests", "4", "--prompt-len", "8", "--output-len", "4",
                      "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    paged = json.loads(result.stdout)["paged_vs_contiguous"][0]
    assert paged["paged_fp32_ms"] > 0
    assert paged["over_fp32"] == pytest.approx(paged["paged_runs_ms"] / paged["paged_fp32_ms"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--num-requests", "0"), "--num-requests 0: must be >= 1"),
        (("--batch-sizes", "16,x"), "--batch-sizes '16,x': expected comma-separated integers"),
        (("--batch-sizes", "0,16", "--output-len", "0"), "--batch-sizes 0, --output-len 0: must be >= 1"),
    ],
)
def test_bad_sizes_are_refused(args, message):
    result = _overlap("--quick", *args)
    assert result.returncode == 2 and message in result.stderr
