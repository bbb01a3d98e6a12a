"""The batching advisor: batch wait ~ batch size / arrival rate, kept under half the SLO."""

from __future__ import annotations

import pytest

from overlap.bench.advise import advise


def test_batch_fills_within_half_the_slo():
    advice = advise(rate=50, slo_ms=300)
    assert advice.max_batch == 7  # 50/s x 0.15 s = 7.5
    assert advice.max_wait_ms == pytest.approx(140)  # 7 / 50 s
    assert advice.max_wait_ms <= 150
    assert any("7 / 50" in line for line in advice.arithmetic)


def test_cap_and_sparse_arrivals():
    assert advise(rate=1000, slo_ms=1000).max_batch == 64
    assert advise(rate=1000, slo_ms=1000, max_batch_cap=16).max_wait_ms == pytest.approx(16)
    sparse = advise(rate=2, slo_ms=300)
    assert sparse.max_batch == 1 and sparse.max_wait_ms == 150


@pytest.mark.parametrize(("rate", "slo"), [(0, 100), (-1, 100), (10, 0), (float("nan"), 100)])
def test_bad_input_is_refused(rate, slo):
    with pytest.raises(ValueError, match="must be a positive"):
        advise(rate, slo)


def test_cli_prints_arithmetic(capsys):
    from overlap.cli import main

    assert main(["bench", "advise", "--rate", "40", "--slo-ms", "400"]) == 0
    out = capsys.readouterr().out
    assert "max_batch = floor(8.00) = 8" in out
    assert "--policy dynamic --policy-args max_batch=8,max_wait_ms=200" in out
    assert main(["bench", "advise", "--rate", "0", "--slo-ms", "400"]) == 2
