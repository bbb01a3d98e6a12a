"""GPU check for overlapped execution (run by bench/gpu/check.sh): the overlap benchmark on a real NVIDIA GPU.

For the tiny default model and a randomly initialised Llama of about 1B parameters (bf16), it runs the closed-loop
decode workload of `overlap bench overlap` with the real model runner on CUDA, for 1 and 2 buffers, and prints one
table: the device busy share measured with CUDA events (overlap.engine.execution.cuda), host time per step, throughput.
Budget: under 8 minutes on one GPU. Without CUDA it stops at once with a clear message (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

# About 1.1B parameters: the TinyLlama-1.1B shape.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def require_cuda() -> str:
    """The GPU's name, or a clear error (exit 2) when this machine has none."""
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(f"overlap gpu check: torch is not installed ({exc})") from None
    if not torch.cuda.is_available():
        print(
            f"overlap gpu check: no CUDA device: torch {torch.__version__} sees no NVIDIA GPU "
            "(torch.cuda.is_available() is False). Run bench/gpu/check.sh on a machine with an NVIDIA GPU and a "
            "CUDA build of torch.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.cuda.get_device_name(0)


# A tiny stand-in for the dry run on CPU (same code path, seconds instead of minutes).
LLAMA_DRY_RUN = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


def build_random_llama(target: Path, shape: dict = LLAMA_1B, device: str = "cuda") -> Path:
    """A randomly initialised Llama (default ~1.1B) in bf16, saved as a Hugging Face folder (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    _progress(f"random Llama: {num_params / 1e9:.2f}B parameters, saving to {target}")
    model.save_pretrained(target, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return target


def measure_model(name: str, model_dir: Path, dtype: str, args: argparse.Namespace) -> list[dict]:
    from overlap.bench.overlap_load import measure_overlap
    from overlap.engine.config import EngineConfig
    from overlap.engine.model.runner import ModelRunner

    prompt_len, max_tokens = 16, 128
    max_seq_len = 256  # prompt + output fit; the pool must hold one full-length sequence
    blocks = -(-(prompt_len + max_tokens) // 16) * args.batch + max_seq_len // 16
    config = EngineConfig(
        device=args.device,
        dtype=dtype,
        num_kv_blocks=blocks,
        max_num_seqs=args.batch,
        block_size=16,
        max_seq_len=max_seq_len,
    )
    runner = ModelRunner(config, model_dir)
    rows = []
    for num_buffers in (1, 2):
        _progress(f"{name}: num_buffers={num_buffers}, {args.steps} steps")
        result = measure_overlap(
            runner,
            num_buffers,
            batch=args.batch,
            steps=args.steps,
            host_ms=args.host_ms,
            warmup_steps=10,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
        )
        rows.append({"model": name, "dtype": dtype, **asdict(result)})
    del runner
    return rows


def format_table(rows: list[dict], gpu: str, args: argparse.Namespace) -> str:
    head = f"Overlap GPU check on {gpu}: batch {args.batch}, extra host time {args.host_ms:g} ms/step"
    columns = ("model", "dtype", "buffers", "device busy %", "host ms/step", "device ms/step", "tokens/s", "vs 1")
    base = {r["model"]: r["tokens_per_s"] for r in rows if r["num_buffers"] == 1}
    lines = [
        [
            r["model"],
            r["dtype"],
            str(r["num_buffers"]),
            f"{100 * (1 - r['idle_share']):.1f}",
            f"{r['host_ms_per_step']:.2f}",
            f"{r['device_ms_per_step']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_s'] / base[r['model']]:.2f}x" if base.get(r["model"]) else "-",
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    out = [
        head,
        "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in lines]
    out.append(
        "device busy % = busy time of forward+sample (from CUDA events; the forward's own time in a CPU dry run) / "
        "elapsed device time"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu/check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="measured steps per row (default 200)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
    parser.add_argument("--host-ms", type=float, default=0.0, help="extra synthetic host time per step (default 0)")
    parser.add_argument("--skip-1b", action="store_true", help="only the tiny model")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="check this script on CPU: the threaded executor instead of the CUDA one, a small random Llama",
    )
    args = parser.parse_args(argv)
    args.device = "cpu" if args.dry_run_cpu else "cuda"
    gpu = "CPU (dry run)" if args.dry_run_cpu else require_cuda()
    started = time.perf_counter()
    from overlap.engine.model.builder import ensure_default_model

    rows = measure_model("tiny (27M)", ensure_default_model(), "float32", args)
    if not args.skip_1b:
        name, shape = ("random Llama (dry run)", LLAMA_DRY_RUN) if args.dry_run_cpu else ("random Llama 1.1B", LLAMA_1B)
        with tempfile.TemporaryDirectory(prefix="overlap-llama-") as tmp:
            model_dir = build_random_llama(Path(tmp), shape, args.device)
            rows += measure_model(name, model_dir, "bfloat16", args)
    print(format_table(rows, gpu, args))
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
