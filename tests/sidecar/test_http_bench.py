"""`overlap bench http` end to end on a tiny workload: both runs alternate over two rounds, the JSON carries every
figure, pooled over the rounds, and the ratio is the median of the rounds' ratios."""

from __future__ import annotations

import json
import subprocess

import pytest
from sidecar_helpers import child_env, overlap_cmd


@pytest.mark.slow
def test_bench_http_json_on_a_tiny_workload():
    cmd = overlap_cmd("bench", "http", "--json", "--concurrency", "4", "--num-requests", "8", "--prompt-len", "16",
                      "--output-len", "8", "--num-threads", "1", "--rounds", "2")  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["workload"]["concurrency"] == 4 and report["workload"]["rounds"] == 2
    for run in ("http", "engine"):
        assert report[run]["requests"] == 2 * 8 and report[run]["errors"] == 0
        assert report[run]["output_tokens"] == 2 * 8 * 8  # EOS ignored: exactly output-len each
        assert report[run]["output_tokens_per_s"] > 0
    assert len(report["ratio_by_round"]) == 2
    assert abs(report["ratio_http_to_engine"] - sum(report["ratio_by_round"]) / 2) < 0.002  # median of two: mean
    assert 0 <= report["sidecar_overhead_p50_ms"] <= report["sidecar_overhead_p99_ms"]
    assert report["sidecar_overhead_p50_ms"] <= report["client_overhead_p50_ms"] <= report["client_overhead_p99_ms"]
    assert 0 < report["launch_to_ready_s"] < 240
    assert report["load_generator_cpu_s"] > 0  # it parsed 64 streamed chunks
    assert 0 < report["sidecar_and_load_generator_machine_share"] <= 1


def test_bench_http_refuses_sizes_below_one(capsys):
    from overlap.cli import main

    assert main(["bench", "http", "--rounds", "0", "--output-len", "-1"]) == 2
    assert "--rounds 0, --output-len -1: must be >= 1" in capsys.readouterr().err
