"""`overlap.engine` sets how libgomp's workers wait before torch loads, and leaves a setting the user made alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from overlap.engine._openmp import SPIN_COUNT

SHOW = "import os, overlap.engine; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, f"{SPIN_COUNT} None"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"), ({"GOMP_SPINCOUNT": "0"}, "0 None")],
)
def test_a_bounded_spin_unless_the_environment_says_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | given
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == expected.split()
