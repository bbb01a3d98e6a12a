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


def test_a_w8a8_step_s_compute_floor_takes_its_projections_at_the_int8_peak():
    """Its decoder projections at the int8 instruction's measured rate, the LM head and attention at the float one
    (both `overlap bench quantized` and `overlap bench engine --quantization w8a8` quote a step against this)."""
    from types import SimpleNamespace

    from overlap.bench.floor import decode_compute_floor, decode_flops, projection_params

    spec = SimpleNamespace(hidden_size=64, head_dim=16, num_heads=4, num_kv_heads=2, num_layers=3,
                           intermediate_size=128, vocab_size=1000)  # fmt: skip
    runner = SimpleNamespace(spec=spec, weight_params=projection_params(spec) + 1000 * 64)
    flops = decode_flops(runner, 16, 100.0)
    assert decode_compute_floor(runner, 16, 100.0, 1e12) == pytest.approx(flops / 1e12)
    projections = 2 * 16 * projection_params(spec)
    floor = decode_compute_floor(runner, 16, 100.0, 1e12, int8_peak=2e12)
    assert floor == pytest.approx(projections / 2e12 + (flops - projections) / 1e12)
    assert floor < flops / 1e12
