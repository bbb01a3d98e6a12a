"""Real compressed-tensors checkpoints for the engine's conformance tests, written by llm-compressor itself from small
random-weight models (tests/support/quant_producer.py), built once and cached under .cache/fixtures/quantized.

llm-compressor runs in its own venv (.cache/tools/llm-compressor) and is never imported here: it pins exact releases
of transformers and compressed-tensors (and pulls datasets, auto-round, accelerate) that the main venv must not be
held to. The producer runs there as a subprocess; this module only starts it and returns the folder it wrote."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from overlap.engine.model.builder import cache_root

# Beside the tiny model in Overlap's cache ($OVERLAP_CACHE_DIR, default ~/.cache/overlap), not in the checkout: a
# fresh clone on the same machine (CI's) finds them built.
VENV = cache_root() / "test-tools" / "llm-compressor"
CACHE = cache_root() / "test-fixtures" / "quantized"
PRODUCER = Path(__file__).with_name("quant_producer.py")
WHEELS = Path("/opt/wheels")
# llmcompressor 0.14.0.1 requires compressed-tensors==0.19.0 exactly and transformers>=5.15,<=5.17 (pinned to the
# one it ran with, so that the written format cannot drift); torch 2.13.0 is the CPU wheel in /opt/wheels (PyPI's
# is a multi-GB CUDA build), installed first from there alone.
TORCH = "torch==2.13.0"
PINS = ("llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "transformers==5.17.0", TORCH)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
SCHEMES = ("FP8_DYNAMIC", "FP8", "W8A8", "W8A16", "W4A16", "W4A16_G32", "W4A16_ASYM")


def _log(message: str) -> None:
    print(f"[quantized_models] {message}", file=sys.stderr, flush=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` across processes (pytest-xdist workers building the same thing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_llmcompressor() -> Path:
    """The python of llm-compressor's venv under .cache/tools (created once, from PyPI and /opt/wheels)."""
    python, stamp = VENV / "bin" / "python", VENV / ".pins"
    with _locked(VENV.with_name(VENV.name + ".lock")):
        if stamp.exists() and stamp.read_text() == "\n".join(PINS):
            return python
        _log(f"creating {VENV} with {' '.join(PINS)} (a few minutes, 1.5 GB)")
        started = time.monotonic()
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run(["python3.11", "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        local = ["--no-index", "--find-links", str(WHEELS), "--no-deps"] if WHEELS.is_dir() else []
        subprocess.run([*pip, *local, TORCH], check=True)
        subprocess.run([*pip, *PINS], check=True)
        stamp.write_text("\n".join(PINS))
        _log(f"venv ready in {time.monotonic() - started:.0f} s")
    return python


def cache_key(family: str, scheme: str) -> str:
    digest = hashlib.sha256(f"{family}\0{scheme}\0{'|'.join(PINS)}\0".encode() + PRODUCER.read_bytes())
    return f"{family}-{scheme.lower()}-{digest.hexdigest()[:12]}"


def build(family: str, scheme: str, dest_root: Path | None = None, timeout: float = 600) -> Path:
    """The folder llm-compressor wrote for `family` quantized with `scheme` (config.json with its
    quantization_config, model.safetensors, recipe.yaml), built on first use, then cached under `dest_root`."""
    if family not in FAMILIES or scheme not in SCHEMES:
        raise ValueError(f"unknown {family}/{scheme}: families {FAMILIES}, schemes {SCHEMES}")
    dest_root = Path(dest_root or CACHE)
    key = cache_key(family, scheme)
    dest = dest_root / key
    if (dest / "config.json").exists():
        return dest
    python = ensure_llmcompressor()
    with _locked(dest_root / ".lock"):  # one build at a time: each takes seconds
        if (dest / "config.json").exists():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=dest_root))
        try:
            _produce(python, family, scheme, tmp / "model", timeout)
            shutil.rmtree(dest, ignore_errors=True)  # a folder left half-written by hand
            (tmp / "model").rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for stale in dest_root.glob(f"{family}-{scheme.lower()}-*"):  # built by an older producer or pins
            if stale != dest:
                shutil.rmtree(stale, ignore_errors=True)
    return dest


def _produce(python: Path, family: str, scheme: str, out: Path, timeout: float) -> None:
    _log(f"producing {family}/{scheme} with llm-compressor into {out}")
    command = [str(python), str(PRODUCER), "--family", family, "--scheme", scheme, "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
    timer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            sys.stderr.write(f"  [producer] {line}")
        code = proc.wait()
    finally:
        timer.cancel()
    if code != 0 or not (out / "config.json").exists():
        why = f"killed after {timeout:.0f} s" if killed.is_set() else f"exit code {code}"
        raise RuntimeError(f"quant_producer failed for {family}/{scheme} ({why}); its output:\n{''.join(lines[-80:])}")
