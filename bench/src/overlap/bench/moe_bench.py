"""overlap bench moe: a mixture of experts' decode step at a real shape's width, its depth cut to fit in memory.

Each step is quoted against its floor, what it must read over the read bandwidth measured here: the dense weights
(attention, router, embedding row, LM head), the experts its tokens were routed to, counted as the step runs (a
batch-1 step runs top-k experts a layer; a batch-64 step nearly all of them), and the K/V; and against its
arithmetic (each token's k experts, the dense projections, attention) over the bf16 matmul peak measured here.
The weights are random and made in memory: no folder is written (one real-width Qwen3-30B-A3B layer is 1.2 GB).
With `--schemes none,w4a16,w8a8` the experts (and attention) are also made in those formats' layouts (as
`overlap model build-shape --quantization` writes them; the routers stay bf16), one runner per format in this
process, and the steps measured in alternating rounds, so the ratios to bf16 come from the same minutes.
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
from overlap.bench.quant_bench import SCHEMES  # the formats a CPU computes quantized (FP8 is dequantized at load)


def add_parser(subparsers) -> None:
    from overlap.engine.model.shapes import SHAPES

    moe_shapes = [name for name, config in SHAPES.items() if "Moe" in config["architectures"][0]
                  or "Mixtral" in config["architectures"][0]]  # fmt: skip
    parser = subparsers.add_parser(
        "moe", help="a mixture of experts' decode step against the bytes of the experts it runs",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model-shape", default="qwen3-30b-a3b", choices=moe_shapes, help="default qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept of the shape's (default 4)")
    parser.add_argument("--schemes", default="none",
                        help="comma-separated formats of the weights, in alternating rounds: none (bf16), w4a16, w8a8 "
                             "(default none)")  # fmt: skip
    add_decode_step_args(parser, "alternating rounds over the batch sizes and formats")
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    print(f"[bench moe] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.engine.errors import ConfigError
    from overlap.engine.model.model_spec import kv_bytes_per_token

    schemes = [s for s in args.schemes.split(",") if s]
    if not schemes or set(schemes) - set(SCHEMES):
        raise ConfigError(f"--schemes {args.schemes!r}: choose from {', '.join(SCHEMES)} (FP8 experts are "
                          "dequantized at load on a CPU: their step is bf16's)")  # fmt: skip
    batches = batch_sizes(args)
    torch.set_num_threads(args.threads)
    runners = {scheme: _runner(args, scheme, batches) for scheme in schemes}
    bandwidth, peak = cpu_read_bandwidth(), cpu_matmul_peak(torch.bfloat16)
    _progress(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, bf16 peak {peak / 1e9:.0f} GFLOP/s")
    steps = {(s, b): [] for s in schemes for b in batches}
    runs = {(s, b): [] for s in schemes for b in batches}
    started = time.perf_counter()
    for round_ in range(args.rounds):
        for batch in batches:
            for scheme, (runner, blocks) in runners.items():
                before = sum(block.expert_runs for block in blocks)
                steps[scheme, batch].append(decode_step(runner, batch, args.context, args.steps))
                runs[scheme, batch].append((sum(block.expert_runs for block in blocks) - before) / (args.steps + 1))
        _progress(f"round {round_ + 1} of {args.rounds} ({time.perf_counter() - started:.0f} s)")
    rows, context = [], args.context + args.steps / 2
    for batch in batches:
        base = statistics.median(steps["none", batch]) if "none" in schemes else None
        for scheme, (runner, blocks) in runners.items():
            spec, moe = runner.spec, runner.spec.moe
            step_s, active = statistics.median(steps[scheme, batch]), statistics.mean(runs[scheme, batch])
            expert_params = 3 * spec.hidden_size * moe.intermediate_size  # gate, up and down
            dense_params = runner.weight_params - len(blocks) * moe.num_experts * expert_params
            per_expert = runner.expert_bytes / (len(blocks) * moe.num_experts)  # as stored
            read = runner.weight_bytes - runner.expert_bytes + active * per_expert
            read += batch * context * kv_bytes_per_token(spec, runner.dtype)
            attention = 4 * context * spec.num_heads * spec.head_dim * spec.num_layers
            flops = batch * (2 * dense_params + 2 * moe.top_k * len(blocks) * expert_params + attention)
            memory_s, compute_s = read / bandwidth, flops / peak
            rows.append({"scheme": scheme, "batch": batch, "step_ms": 1000 * step_s,
                         "rounds_ms": [1000 * s for s in steps[scheme, batch]],
                         "over_bf16": None if base is None else step_s / base,
                         "active_experts_per_layer": active / len(blocks), "read_gb": read / 1e9,
                         "memory_floor_ms": 1000 * memory_s, "compute_floor_ms": 1000 * compute_s,
                         "step_over_floor": step_s / max(memory_s, compute_s)})  # fmt: skip
    first = next(iter(runners.values()))[0]
    result = {"model_shape": args.model_shape, "layers": args.layers, "experts": first.spec.moe.num_experts,
              "top_k": first.spec.moe.top_k, "threads": args.threads, "context": args.context,
              "read_bandwidth_gb_s": bandwidth / 1e9, "bf16_peak_gflop_s": peak / 1e9,
              "weight_gb": {s: r.weight_bytes / 1e9 for s, (r, _) in runners.items()},
              "kernels": {s: r.kernels for s, (r, _) in runners.items()}, "rows": rows}  # fmt: skip
    for runner, _ in runners.values():
        runner.close()
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def _runner(args: argparse.Namespace, scheme: str, batches: list[int]):
    """The shape cut to `args.layers` layers with random weights in `scheme`'s layout, and its sparse blocks."""
    from overlap.engine.config import EngineConfig
    from overlap.engine.model.layers.moe import SparseMoE
    from overlap.engine.model.runner import ModelRunner
    from overlap.engine.model.shapes import shape_config

    config = shape_config(args.model_shape, None if scheme == "none" else scheme, layers=args.layers)
    tokens = args.context + args.steps + 2
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        kv_blocks = max(batches) * -(-tokens // 16) + 16
        engine_config = EngineConfig(dtype="bfloat16", num_threads=args.threads, max_seq_len=tokens,
                                     max_num_seqs=max(batches), num_kv_blocks=kv_blocks)  # fmt: skip
        _progress(f"{args.model_shape} cut to {args.layers} layers, {scheme}: making random weights")
        runner = ModelRunner(engine_config, folder, random_weights=True)
    blocks = [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, SparseMoE)]
    _progress(f"{scheme}: {runner.weight_bytes / 1e9:.2f} GB of weights ({runner.expert_bytes / 1e9:.2f} GB of "
              f"experts, {len(blocks)} sparse layers of {runner.spec.moe.num_experts}, top-{runner.spec.moe.top_k}); "
              f"{runner.kernels}")  # fmt: skip
    return runner, blocks


def _table(result: dict) -> str:
    weights = ", ".join(f"{s} {gb:.2f}" for s, gb in result["weight_gb"].items())
    lines = [f"overlap bench moe: {result['model_shape']} cut to {result['layers']} layers ({result['experts']} "
             f"experts, top-{result['top_k']}), bf16 activations, {result['threads']} threads, context "
             f"{result['context']}; GB of weights: {weights}; read bandwidth {result['read_bandwidth_gb_s']:.1f} "
             f"GB/s, bf16 matmul peak {result['bf16_peak_gflop_s']:.0f} GFLOP/s (measured here)"]  # fmt: skip
    lines += [f"  {scheme}: {kernels}" for scheme, kernels in result["kernels"].items()]
    lines += ["", "batch | format | experts run a layer | GB read | step ms (median of rounds) | / bf16 | memory floor "
              "| compute floor | step / floor", "-" * 120]  # fmt: skip
    for r in result["rows"]:
        ratio = "-" if r["over_bf16"] is None else f"{r['over_bf16']:.2f}"
        rounds = ", ".join(f"{ms:.1f}" for ms in r["rounds_ms"])
        lines.append(f"{r['batch']:5d} | {r['scheme']:6s} | {r['active_experts_per_layer']:19.1f} | "
                     f"{r['read_gb']:7.2f} | {r['step_ms']:7.1f} ({rounds}) | {ratio:>6s} | "
                     f"{r['memory_floor_ms']:9.1f} ms | {r['compute_floor_ms']:10.1f} ms | "
                     f"{r['step_over_floor']:.2f}")  # fmt: skip
    return "\n".join(lines)
