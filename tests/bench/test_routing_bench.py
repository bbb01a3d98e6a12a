"""`overlap bench routing`: its workloads' shapes, the pick-latency probe, and one quick run of the real thing (two
simulated replicas, two routers per policy, no request lost)."""

from __future__ import annotations

import json
import subprocess
import sys

from overlap.bench.routing import make_workload, pick_latency


def test_workloads_share_what_they_claim():
    shared = make_workload("shared-prefix", 0.25)
    groups = {c.session.split("u")[0] for c in shared}
    assert len(shared) == 8 * len(groups) and all(len(c.turns) == 3 for c in shared)
    first_turns = {tuple(c.turns[0][0][:2048]) for c in shared}
    assert len(first_turns) == len(groups)  # one system prompt per group
    agents = make_workload("agent", 0.25)
    assert all(len(c.turns) == 8 and len(c.turns[0][0]) == 768 for c in agents)
    solo = make_workload("no-sharing", 0.25)
    assert len({tuple(c.turns[0][0][:64]) for c in solo}) == len(solo)
    assert make_workload("shared-prefix", 0.25) == shared  # seeded


def test_a_pick_takes_well_under_a_millisecond_on_a_large_index():
    picks = pick_latency(4, 8192, 256, picks=300)
    assert picks["index_blocks"] >= 4 * 8192 and picks["p99_ms"] < 5  # the goal is < 1 ms; loose on a loaded CI


def test_a_quick_run_routes_every_request_under_two_policies_through_two_routers(tmp_path):
    out = tmp_path / "routing.json"
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "routing", "--quick", "--workloads", "no-sharing",
           "--policies", "least-queue,prefix", "--routers", "2", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "2 replicas, 2 routers" in run.stdout
        and "| no-sharing | prefix |" in run.stdout
        and "pick latency" in run.stdout
        and "tokenizing" in run.stdout
    )
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [t["tokens"] for t in report["tokenize"]] == sorted(t["tokens"] for t in report["tokenize"])
    assert all(t["encode_ms"] > 0 and t["chat_ms"] > 0 for t in report["tokenize"])
    assert [r["policy"] for r in rows] == ["least-queue", "prefix"]
    assert all(r["errors"] == 0 and r["requests"] == 24 and r["output_tok_s"] > 0 for r in rows)
