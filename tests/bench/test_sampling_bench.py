"""`overlap bench sampling` end to end on a tiny batch: every variant generates the same token count and the
overheads are computed from the medians it reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_tiny_run_reports_every_variant(tiny_model_dir):
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "sampling", "--batch", "4", "--output-len", "6",
           "--rounds", "1", "--model", str(tiny_model_dir), "--json"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # progress goes to stderr
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == {"plain", "logprobs", "penalties", "json_schema"}
    plain = rows["plain"]["us_per_token"]
    for row in rows.values():
        assert row["tokens"] == 4 * 6 and row["median_s"] > 0
        assert row["overhead_us_per_token"] == pytest.approx(row["us_per_token"] - plain)
        assert row["relative"] == pytest.approx(row["us_per_token"] / plain)
