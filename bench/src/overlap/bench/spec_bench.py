"""overlap bench spec: speculative decoding (ngram prompt lookup) against none, per-token latency at batch 1 and 4.

Two workloads, greedy, EOS ignored, each request's output `--output-len` tokens:
  quoting  prompts that repeat a random unit of tokens, on a model whose output quotes its context (`tiny-copy`, or
           `<shape>-copy` with --model-shape: the same shape and cost as the random-weight model, weights wired to an
           induction circuit, bench/copy_model.py); what code edits and summaries look like to a proposer
  random   random prompts on the random-weight model (the tiny model, or the shape's): proposals are few and rejected
Each (workload, batch size) runs with and without `--speculative-config`, in alternating rounds in one process, so
that the ratios come from the same minutes of the same machine. Per-token latency is a request's time per output
token after its first (TPOT: finish minus first token over tokens - 1), the median over its batch and the rounds;
acceptance is accepted / proposed tokens, and per position the share of steps whose i-th proposal was accepted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

WORKLOADS = ("quoting", "random")


def add_parser(subparsers) -> None:
    from overlap.engine.model.shapes import SHAPES

    parser = subparsers.add_parser(
        "spec", help="speculative decoding (ngram) vs none: per-token latency at batch 1 and 4, acceptance",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="32 output tokens, one round (under a minute, tiny)")
    parser.add_argument("--model-shape", choices=list(SHAPES),
                        help="a real shape (random weights, and its copying variant for quoting), built into the cache "
                        "on first use; default: the tiny model")  # fmt: skip
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated (default 1,4)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default quoting,random)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k (default 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="default 2")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="default 4")
    parser.add_argument("--unit-len", type=int, default=24, help="tokens of the unit a quoting prompt repeats 4 times")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default 128; quick: 32)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3; quick: 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--dtype", help="default: bfloat16 with --model-shape, else float32")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    print(f"[bench spec] {message}", file=sys.stderr, flush=True)


def _requests(workload: str, batch: int, unit_len: int, output_len: int, vocab: int, seed: int) -> dict:
    from overlap.engine.types import SamplingParams

    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    requests = {}
    for i in range(batch):
        if workload == "quoting":
            unit = [rng.randrange(3, vocab) for _ in range(unit_len)]
            prompt = unit * 4 + unit[: unit_len // 2]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(unit_len * 4 + unit_len // 2)]
        requests[f"{workload}-{seed}-{i}"] = (prompt, sampling)
    return requests


def _measure(engine, requests: dict) -> dict:
    """Run `requests` together to the end; per-token latencies and the step / speculation counters they took."""
    from overlap.engine.types import RequestSpec

    before = engine.stats()
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(RequestSpec(rid, prompt, sampling))
    start = time.perf_counter()
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    wall = time.perf_counter() - start
    after = engine.stats()
    tpot = []
    for out in finals.values():
        assert out.finish_reason.value == "length", f"{out.request_id}: {out.finish_reason} {out.error}"
        tpot.append((out.times.finished - out.times.first_token) / max(1, out.num_output_tokens - 1))

    def delta(key: str):
        if key.endswith("per_pos"):
            old = before[key] or [0] * len(after[key])
            return [a - b for a, b in zip(after[key], old, strict=True)]
        return after[key] - before[key]

    return {
        "tpot_s": tpot,
        "wall_s": wall,
        "tokens": sum(out.num_output_tokens for out in finals.values()),
        "steps": delta("num_steps_total"),
        "drafts": delta("spec_decode_num_drafts_total"),
        "draft_tokens": delta("spec_decode_num_draft_tokens_total"),
        "accepted": delta("spec_decode_num_accepted_tokens_total"),
        "accepted_per_pos": delta("spec_decode_num_accepted_tokens_per_pos"),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.bench.copy_model import ensure_copy_model
    from overlap.engine.config import EngineConfig
    from overlap.engine.core import Engine
    from overlap.engine.errors import ConfigError
    from overlap.engine.model.builder import ensure_default_model

    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated integers") from None
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        raise ConfigError(f"--workloads {args.workloads!r}: choose from {', '.join(WORKLOADS)}")
    torch.set_num_threads(args.threads)
    output_len = args.output_len or (32 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}  # fmt: skip
    if args.model_shape:
        from overlap.engine.model.shapes import ensure_shape_model

        build = {"quoting": lambda: ensure_copy_model(args.model_shape, progress=_progress),
                 "random": lambda: ensure_shape_model(args.model_shape, progress=_progress)}  # fmt: skip
    else:
        build = {"quoting": ensure_copy_model, "random": ensure_default_model}
    models = {workload: build[workload]() for workload in workloads}
    dtype = args.dtype or ("bfloat16" if args.model_shape else "float32")
    max_seq_len = args.unit_len * 5 + output_len + args.num_speculative_tokens + 16
    blocks = max(batches) * -(-max_seq_len // 16) + 16
    engines = {}
    for workload, folder in models.items():
        for mode in ("off", "ngram"):
            config = EngineConfig(model=str(folder), dtype=dtype, num_threads=args.threads, max_seq_len=max_seq_len,
                                  num_kv_blocks=blocks, max_num_seqs=max(batches), enable_prefix_caching=False,
                                  speculative_config=spec if mode == "ngram" else None)  # fmt: skip
            engine = engines[workload, mode] = Engine(config)
            _measure(engine, _requests(workload, 2, 8, 8, engine.vocab_size, seed=-1))  # warm-up
    results: dict[tuple, list[dict]] = {}
    for r in range(rounds):
        for workload in workloads:
            for batch in batches:
                for mode in ("off", "ngram"):
                    engine = engines[workload, mode]
                    requests = _requests(workload, batch, args.unit_len, output_len, engine.vocab_size, seed=r)
                    m = _measure(engine, requests)
                    results.setdefault((workload, batch, mode), []).append(m)
                    _progress(f"round {r + 1}/{rounds} {workload} batch {batch} {mode}: "
                              f"{statistics.median(m['tpot_s']) * 1e3:.2f} ms/token, {m['steps']} steps")  # fmt: skip
    for engine in engines.values():
        engine.close()
    rows = []
    for workload in workloads:
        for batch in batches:
            off = statistics.median(t for m in results[workload, batch, "off"] for t in m["tpot_s"])
            for mode in ("off", "ngram"):
                ms = results[workload, batch, mode]
                tpot = statistics.median(t for m in ms for t in m["tpot_s"])
                drafts = sum(m["drafts"] for m in ms)
                draft_tokens, accepted = sum(m["draft_tokens"] for m in ms), sum(m["accepted"] for m in ms)
                per_pos = [sum(col) for col in zip(*(m["accepted_per_pos"] for m in ms), strict=True)] if drafts else []
                rows.append({
                    "workload": workload, "batch": batch, "mode": mode, "tpot_ms": tpot * 1e3,
                    "vs_off": off / tpot, "tokens": sum(m["tokens"] for m in ms), "steps": sum(m["steps"] for m in ms),
                    "tokens_per_s": sum(m["tokens"] for m in ms) / sum(m["wall_s"] for m in ms),
                    "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                    "acceptance": accepted / draft_tokens if draft_tokens else None,
                    "tokens_per_verify_step": (accepted + drafts) / drafts if drafts else None,
                    "acceptance_per_position": [n / drafts for n in per_pos] if drafts else [],
                })  # fmt: skip
    report = {"model_shape": args.model_shape or "tiny", "models": {k: str(v) for k, v in models.items()},
              "dtype": dtype, "threads": args.threads, "output_len": output_len, "rounds": rounds,
              "speculative_config": spec, "rows": rows}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\noverlap bench spec: {report['model_shape']} ({dtype}), {output_len} output tokens per request, greedy, "
          f"{rounds} alternating round(s), {args.threads} threads")  # fmt: skip
    print(f"--speculative-config '{json.dumps(spec)}'")
    print(f"{'workload':8s} | {'batch':>5s} | {'spec':5s} | {'ms/token':>8s} | {'vs off':>6s} | {'tok/s':>7s} | "
          f"{'steps':>5s} | {'accepted':>8s} | {'tok/verify':>10s} | acceptance by position")  # fmt: skip
    print("-" * 112)
    for row in rows:
        accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        per_step = "-" if row["tokens_per_verify_step"] is None else f"{row['tokens_per_verify_step']:.2f}"
        per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]) or "-"
        print(f"{row['workload']:8s} | {row['batch']:5d} | {row['mode']:5s} | {row['tpot_ms']:8.2f} | "
              f"{row['vs_off']:5.2f}x | {row['tokens_per_s']:7.1f} | {row['steps']:5d} | {accept:>8s} | "
              f"{per_step:>10s} | {per_pos}")  # fmt: skip
    return 0
