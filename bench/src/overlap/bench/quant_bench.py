"""overlap bench quantized: a real shape's decode step in bf16 and in its quantized formats, side by side.

The shape is built once per format (`overlap model build-shape NAME [--quantization Q]`: random weights, the
projections written as llm-compressor's scheme writes them), every runner loaded in this process, and the decode
steps measured in alternating rounds (each round: every batch size, every format in turn), so that the ratios to bf16
come from the same minutes of the same machine. Each step is quoted against its floor: the bytes it must read (the
weights as stored, the K/V) over the read bandwidth measured here, and its multiply-adds over the peak of the
instruction that computes them, measured here: a large bf16 matmul's for bf16 and W4A16 (whose codes become bf16 for
the dot), and for W8A8's decoder projections a large int8 matmul's (VNNI's vpdpbusd does twice vdpbf16ps's
multiply-adds a cycle), its LM head and attention staying at the bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from overlap.bench.decode_steps import add_decode_step_args, batch_sizes, decode_step
from overlap.bench.floor import (
    cpu_int8_matmul_peak,
    cpu_matmul_peak,
    cpu_read_bandwidth,
    decode_compute_floor,
    decode_floor_bytes,
)

SCHEMES = ("none", "w8a8", "w4a16")


def add_parser(subparsers) -> None:
    from overlap.engine.model.shapes import SHAPES

    parser = subparsers.add_parser(
        "quantized", help="a real shape's decode step in bf16, W8A8 and W4A16, side by side", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model-shape", default="qwen2.5-0.5b", choices=list(SHAPES), help="default qwen2.5-0.5b")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated of {', '.join(SCHEMES)}")
    add_decode_step_args(parser, "alternating rounds")
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    print(f"[bench quantized] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.engine.config import EngineConfig
    from overlap.engine.errors import ConfigError
    from overlap.engine.model.runner import ModelRunner
    from overlap.engine.model.shapes import ensure_shape_model

    schemes = [s for s in args.schemes.split(",") if s]
    if not schemes or set(schemes) - set(SCHEMES):
        raise ConfigError(f"--schemes {args.schemes!r}: choose from {', '.join(SCHEMES)}")
    batches = batch_sizes(args)
    torch.set_num_threads(args.threads)
    tokens = args.context + args.steps + 2
    blocks = max(batches) * -(-tokens // 16) + 16
    runners = {}
    for scheme in schemes:
        folder = ensure_shape_model(args.model_shape, _progress, None if scheme == "none" else scheme)
        config = EngineConfig(model=str(folder), dtype="bfloat16", num_threads=args.threads, max_seq_len=tokens,
                              max_num_seqs=max(batches), num_kv_blocks=blocks)  # fmt: skip
        runners[scheme] = ModelRunner(config, folder)
        _progress(f"{scheme}: {runners[scheme].weight_bytes / 1e6:.0f} MB of weights; {runners[scheme].kernels}")
    bandwidth, peak, int8_peak = cpu_read_bandwidth(), cpu_matmul_peak(torch.bfloat16), cpu_int8_matmul_peak()
    _progress(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, bf16 matmul peak {peak / 1e9:.0f} GFLOP/s, int8 matmul "
              f"peak {int8_peak / 1e9:.0f} GOP/s")  # fmt: skip
    steps = {(s, b): [] for s in schemes for b in batches}
    started = time.perf_counter()
    for round_ in range(args.rounds):
        for batch in batches:
            for scheme in schemes:
                steps[scheme, batch].append(decode_step(runners[scheme], batch, args.context, args.steps))
        _progress(f"round {round_ + 1} of {args.rounds} ({time.perf_counter() - started:.0f} s)")
    rows = []
    for batch in batches:
        base = statistics.median(steps["none", batch]) if "none" in schemes else None
        for scheme in schemes:
            runner, step_s = runners[scheme], statistics.median(steps[scheme, batch])
            context = args.context + args.steps / 2
            memory_s = decode_floor_bytes(runner, batch, context) / bandwidth
            compute_s = decode_compute_floor(runner, batch, context, peak, int8_peak if scheme == "w8a8" else 0.0)
            rows.append({"scheme": scheme, "batch": batch, "step_ms": 1000 * step_s,
                         "rounds_ms": [1000 * s for s in steps[scheme, batch]],
                         "over_bf16": None if base is None else step_s / base,
                         "weight_mb": runner.weight_bytes / 1e6, "memory_floor_ms": 1000 * memory_s,
                         "compute_floor_ms": 1000 * compute_s,
                         "step_over_floor": step_s / max(memory_s, compute_s)})  # fmt: skip
    result = {"model_shape": args.model_shape, "threads": args.threads, "context": args.context,
              "read_bandwidth_gb_s": bandwidth / 1e9, "bf16_peak_gflop_s": peak / 1e9,
              "int8_peak_gop_s": int8_peak / 1e9,
              "kernels": {s: r.kernels for s, r in runners.items()}, "rows": rows}  # fmt: skip
    for runner in runners.values():
        runner.close()
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def _table(result: dict) -> str:
    lines = [f"overlap bench quantized: {result['model_shape']}, bf16 activations, {result['threads']} threads, "
             f"context {result['context']}; read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s, bf16 matmul "
             f"peak {result['bf16_peak_gflop_s']:.0f} GFLOP/s, int8 matmul peak {result['int8_peak_gop_s']:.0f} GOP/s "
             "(measured here)"]  # fmt: skip
    lines += [f"  {scheme}: {kernels}" for scheme, kernels in result["kernels"].items()]
    lines += ["", "batch | format | weights MB | step ms (median of rounds) | / bf16 | memory floor | compute floor | "
              "step / floor", "-" * 110]  # fmt: skip
    for r in result["rows"]:
        ratio = "-" if r["over_bf16"] is None else f"{r['over_bf16']:.2f}"
        rounds = ", ".join(f"{ms:.1f}" for ms in r["rounds_ms"])
        lines.append(f"{r['batch']:5d} | {r['scheme']:6s} | {r['weight_mb']:10.0f} | {r['step_ms']:7.1f} ({rounds}) | "
                     f"{ratio:>6s} | {r['memory_floor_ms']:9.1f} ms | {r['compute_floor_ms']:10.1f} ms | "
                     f"{r['step_over_floor']:.2f}")  # fmt: skip
    return "\n".join(lines)
