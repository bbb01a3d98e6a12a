"""overlap bench moe: a mixture of experts' decode step at a real shape's width, its depth cut to fit in memory.

Each step is quoted against its floor, what it must read over the read bandwidth measured here: the dense weights
(attention, router, embedding row, LM head), the experts its tokens were routed to, counted as the step runs (a
batch-1 step runs top-k experts a layer; a batch-64 step nearly all of them), and the K/V; and against its
arithmetic (each token's k experts, the dense projections, attention) over the bf16 matmul peak measured here.
The weights are random and made in memory: no folder is written (one real-width Qwen3-30B-A3B layer is 1.2 GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overlap.bench.decode_steps import add_decode_step_args, batch_sizes, decode_step
from overlap.bench.floor import cpu_matmul_peak, cpu_read_bandwidth


def add_parser(subparsers) -> None:
    from overlap.engine.model.shapes import SHAPES

    moe_shapes = [name for name, config in SHAPES.items() if "Moe" in config["architectures"][0]
                  or "Mixtral" in config["architectures"][0]]  # fmt: skip
    parser = subparsers.add_parser(
        "moe", help="a mixture of experts' decode step against the bytes of the experts it runs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model-shape", default="qwen3-30b-a3b", choices=moe_shapes, help="default qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept of the shape's (default 4)")
    add_decode_step_args(parser, "rounds over the batch sizes")
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    print(f"[bench moe] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.engine.config import EngineConfig
    from overlap.engine.model.layers.moe import SparseMoE
    from overlap.engine.model.model_spec import kv_bytes_per_token
    from overlap.engine.model.runner import ModelRunner
    from overlap.engine.model.shapes import shape_config

    batches = batch_sizes(args)
    torch.set_num_threads(args.threads)
    config = shape_config(args.model_shape, layers=args.layers)
    tokens = args.context + args.steps + 2
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        engine_config = EngineConfig(
            dtype="bfloat16",
            num_threads=args.threads,
            max_seq_len=tokens,
            max_num_seqs=max(batches),
            num_kv_blocks=max(batches) * -(-tokens // 16) + 16,
        )
        _progress(f"{args.model_shape} cut to {args.layers} layers: making random weights")
        runner = ModelRunner(engine_config, folder, random_weights=True)
    spec, moe = runner.spec, runner.spec.moe
    blocks = [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoE)]
    h, width = spec.hidden_size, moe.intermediate_size
    expert_params = 3 * h * width  # gate, up and down
    dense_params = runner.weight_params - len(blocks) * moe.num_experts * expert_params
    bandwidth, peak = cpu_read_bandwidth(), cpu_matmul_peak(torch.bfloat16)
    _progress(f"{runner.weight_bytes / 1e9:.2f} GB of weights ({len(blocks)} sparse layers of {moe.num_experts} "
              f"experts, top-{moe.top_k}); read bandwidth {bandwidth / 1e9:.1f} GB/s, bf16 peak {peak / 1e9:.0f} "
              f"GFLOP/s; {runner.kernels}")  # fmt: skip
    steps = {b: [] for b in batches}
    runs = {b: [] for b in batches}
    started = time.perf_counter()
    for round_ in range(args.rounds):
        for batch in batches:
            before = sum(block.expert_runs for block in blocks)
            steps[batch].append(decode_step(runner, batch, args.context, args.steps))
            runs[batch].append((sum(block.expert_runs for block in blocks) - before) / (args.steps + 1))
        _progress(f"round {round_ + 1} of {args.rounds} ({time.perf_counter() - started:.0f} s)")
    rows = []
    context = args.context + args.steps / 2
    for batch in batches:
        step_s, active = statistics.median(steps[batch]), statistics.mean(runs[batch])
        read = 2 * (dense_params + active * expert_params) + batch * context * kv_bytes_per_token(spec, runner.dtype)
        attention = 4 * context * spec.num_heads * spec.head_dim * spec.num_layers
        flops = batch * (2 * dense_params + 2 * moe.top_k * len(blocks) * expert_params + attention)
        memory_s, compute_s = read / bandwidth, flops / peak
        rows.append({"batch": batch, "step_ms": 1000 * step_s, "rounds_ms": [1000 * s for s in steps[batch]],
                     "active_experts_per_layer": active / len(blocks), "read_gb": read / 1e9,
                     "memory_floor_ms": 1000 * memory_s, "compute_floor_ms": 1000 * compute_s,
                     "step_over_floor": step_s / max(memory_s, compute_s)})  # fmt: skip
    result = {"model_shape": args.model_shape, "layers": args.layers, "experts": moe.num_experts, "top_k": moe.top_k,
              "threads": args.threads, "context": args.context, "read_bandwidth_gb_s": bandwidth / 1e9,
              "bf16_peak_gflop_s": peak / 1e9, "weight_gb": runner.weight_bytes / 1e9, "kernels": runner.kernels,
              "rows": rows}  # fmt: skip
    runner.close()
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def _table(result: dict) -> str:
    lines = [f"overlap bench moe: {result['model_shape']} cut to {result['layers']} layers ({result['experts']} "
             f"experts, top-{result['top_k']}), bf16, {result['threads']} threads, context {result['context']}; "
             f"{result['weight_gb']:.2f} GB of weights; read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s, "
             f"bf16 matmul peak {result['bf16_peak_gflop_s']:.0f} GFLOP/s (measured here)",
             f"  {result['kernels']}", "",
             "batch | experts run a layer | GB read | step ms (median of rounds) | memory floor | compute floor | "
             "step / floor", "-" * 110]  # fmt: skip
    for r in result["rows"]:
        rounds = ", ".join(f"{ms:.1f}" for ms in r["rounds_ms"])
        lines.append(f"{r['batch']:5d} | {r['active_experts_per_layer']:19.1f} | {r['read_gb']:7.2f} | "
                     f"{r['step_ms']:7.1f} ({rounds}) | {r['memory_floor_ms']:9.1f} ms | "
                     f"{r['compute_floor_ms']:10.1f} ms | {r['step_over_floor']:.2f}")  # fmt: skip
    return "\n".join(lines)
