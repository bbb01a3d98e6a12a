#!/usr/bin/env bash
# Overlapped execution on a real NVIDIA GPU: the overlap benchmark with the real model runner (tiny model and a
# random ~1B Llama in bf16), device busy share from CUDA events for 1 and 2 buffers, one table. Under 8 minutes.
# Usage: bench/gpu/check.sh [--steps N] [--batch B] [--skip-1b] [--json FILE]   (--dry-run-cpu: check it on CPU)
# Without a GPU it exits with code 2 and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import overlap.bench.gpu_check" 2>/dev/null; then
  echo "bench/gpu/check.sh: cannot import overlap with $PY; install it first: pip install -e engine -e sidecar -e operator -e bench (with a CUDA build of torch)" >&2
  exit 2
fi
exec timeout 480 "$PY" -m overlap.bench.gpu_check "$@"
