"""`overlap bench lora` end to end on the tiny model (quick, small): every variant measured, the switch cost read,
and the adapters it writes load as PEFT's layout (the engine checks them like any other)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_run_reports_each_adapter_count_and_the_switch_cost(tiny_model_dir):
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "lora", "--quick", "--batch", "4", "--rank", "4",
           "--prompt-len", "8", "--output-len", "4", "--threads", "1", "--json"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # progress goes to stderr
    assert [row["adapters"] for row in report["rows"]] == [0, 1, 4, 8]
    assert all(row["tok_s"] > 0 for row in report["rows"]) and report["rows"][0]["vs_base"] == 1.0
    assert report["switch"]["cold_s"] > 0 and report["switch"]["warm_s"] > 0
