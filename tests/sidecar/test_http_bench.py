"""`overlap bench http` end to end on a tiny workload: the runs alternate over two rounds, the JSON carries every
figure, pooled over the rounds, and each ratio is the median of the rounds' ratios."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support.sidecar import Stack, child_env, free_port, overlap_cmd


@pytest.mark.slow
def test_bench_http_json_on_a_tiny_workload(tmp_short, tiny_model_dir):
    # The peer: a real sidecar and engine server whose scripted runner takes 0.1 s a step, far slower than the tiny
    # model's ~10 ms steps at this size, so the ratio to it is well above 1 and its P99 well above ours.
    peer = Stack(tmp_short, tiny_model_dir, step_s=0.1).start()
    try:
        sizes = ["--concurrency", "4", "--num-requests", "8", "--prompt-len", "16", "--output-len", "8"]
        cmd = overlap_cmd(
            "bench", "http", "--json", *sizes, "--num-threads", "1", "--dtype", "bfloat16", "--rounds", "2",
            "--settle-s", "0.2", "--peer", peer.base_url,
        )  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=child_env())
    finally:
        peer.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["workload"]["concurrency"] == 4 and report["workload"]["rounds"] == 2
    assert report["workload"]["settle_s"] == 0.2
    assert report["workload"]["engine_overrides"] == {"num_threads": 1, "dtype": "bfloat16"}  # both runs' config
    assert isinstance(report["workload"]["seed"], int)  # drawn for this run: --seed N repeats its prompts
    for run in ("http", "engine", "peer"):
        assert report[run]["requests"] == 2 * 8 and report[run]["errors"] == 0
        assert report[run]["output_tokens"] == 2 * 8 * 8  # EOS ignored: exactly output-len each
        assert report[run]["output_tokens_per_s"] > 0
    assert len(report["ratio_by_round"]) == 2
    assert abs(report["ratio_http_to_engine"] - sum(report["ratio_by_round"]) / 2) < 0.002  # median of two: mean
    assert report["peer"]["name"] == f"peer {peer.base_url}"
    assert len(report["peer_ratio_by_round"]) == 2 and min(report["peer_ratio_by_round"]) > 1.5
    assert abs(report["ratio_http_to_peer"] - sum(report["peer_ratio_by_round"]) / 2) < 0.002
    assert report["peer"]["latency_p50_s"] >= 8 * 0.1  # eight steps of the scripted runner, at least
    assert report["p99_below_peer"] and report["peer_ratio_target"] == 1.2
    assert 0 <= report["sidecar_overhead_p50_ms"] <= report["sidecar_overhead_p99_ms"]
    assert report["sidecar_overhead_p50_ms"] <= report["client_overhead_p50_ms"] <= report["client_overhead_p99_ms"]
    assert 0 < report["launch_to_ready_s"] < 240
    assert report["load_generator_cpu_s"] > 0  # it parsed 64 streamed chunks
    assert 0 < report["sidecar_and_load_generator_machine_share"] <= 1


def test_bench_http_refuses_sizes_below_one(capsys):
    from overlap.cli import main

    assert main(["bench", "http", "--rounds", "0", "--output-len", "-1"]) == 2
    assert "--rounds 0, --output-len -1: must be >= 1" in capsys.readouterr().err
    assert main(["bench", "http", "--settle-s", "-1"]) == 2
    assert "--settle-s -1: must be in 0..600" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--peer", "--target"])
def test_bench_http_reports_an_unreachable_server_before_launching_anything(flag, capsys):
    from overlap.cli import main

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["bench", "http", "--quick", flag, url]) == 2
    assert f"{flag} {url}: cannot read {url}/v1/models" in capsys.readouterr().err
