#!/usr/bin/env bash
# The GPU check: correctness against transformers on the GPU, decode and prefill speed of ~1B and ~8B Llama shapes
# (random bf16 weights made on the device) against the memory-streaming floor, busy share by CUDA events and by
# kernel time; W4A16, W8A8, FP8 and block-FP8 at the 8B shape (case quantized) against their floor and a dequantized
# reference; a small Qwen3-MoE (fused-MoE kernels) and Gemma 3 against transformers and their real widths' decode
# steps (cases moe, gemma); an ngram step at the 8B shape (case speculative); LoRA's Triton kernels against the CPU
# path (case lora). One JSON line per case goes to --out as it runs; a table at the end. Under 8 minutes on an H200.
#
# Nothing is installed: it runs with the python3 that has a CUDA build of torch, Triton and transformers, and puts
# the components' sources on PYTHONPATH (the engine needs no other package for this).
# Usage: bench/gpu/check.sh [--out FILE.jsonl]
#        [--cases env,bandwidth,correctness,decode,prefill,busy,tensor_parallel,profile,quantized,moe,gemma,speculative,lora]
#        [--steps N]   (tensor_parallel: 2 ranks against 1 where there are 2+ GPUs; "skipped: 1 GPU" otherwise)
#        bench/gpu/check.sh --dry-run-cpu   (every case on this CPU with small shapes: checks the script)
# Without a GPU (and without --dry-run-cpu) it exits with code 2 and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD/engine/src:$PWD/bench/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "bench/gpu/check.sh: $PY cannot import torch; run it with the python3 that has a CUDA build of torch (PYTHON=...)" >&2
  exit 2
fi
exec timeout 480 "$PY" -m overlap.bench.gpu_check "$@"
