"""`overlap bench quantized` refuses bad arguments before it builds or loads anything (a run builds real shapes in
three formats: minutes, so it lives in `make bench`, not here; its kernels are tested in test_quantized.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("args", "message"), [
    (["--schemes", "none,w3a16"], "--schemes 'none,w3a16': choose from none, w8a8, w4a16"),
    (["--batch-sizes", "1,x"], "--batch-sizes '1,x': expected comma-separated integers"),
    (["--rounds", "0"], "must be >= 1"),
])  # fmt: skip
def test_bad_arguments_are_refused_before_anything_is_built(args, message):
    cmd = [sys.executable, "-m", "overlap.cli", "bench", "quantized", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert "building" not in result.stderr
