"""`overlap bench sampling`: what the request features of the OpenAI surface cost the engine per token.

One process, the tiny default model (or --model), one batch of B requests decoded together, EOS ignored so every
variant generates the same tokens count. Variants, all B requests alike:
  plain        greedy-free sampling at temperature 1 (the baseline)
  logprobs     logprobs=5: log_softmax and top-5 of each sampled row
  penalties    presence 0.5, frequency 0.5, repetition 1.1 (the per-request token history on the device)
  json_schema  an llguidance JSON-schema grammar per request (mask per row, matcher advanced on the host)
Rounds interleave the variants, so a shared machine's drift hits them alike; the table gives each variant's median
engine wall time per generated token and its overhead over plain, per token (us/token: the batch's step time
divided by its tokens, so at batch B one request's own overhead is B times that).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
VARIANTS = ("plain", "logprobs", "penalties", "json_schema")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sampling",
        help="per-token cost of logprobs, penalties and JSON-schema grammars against plain sampling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="batch 64, 32 output tokens, 2 rounds (under 60 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--model", help="model folder (default: the tiny default model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--batch", type=int, default=64, help="requests decoded together (default 64)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default 64; quick: 32)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per variant (default 3; quick: 2)")
    parser.set_defaults(func=run)


def _sampling(variant: str, seed: int, max_tokens: int):
    from overlap.engine.types import SamplingParams

    common = {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True}
    if variant == "logprobs":
        return SamplingParams(**common, logprobs=5)
    if variant == "penalties":
        return SamplingParams(**common, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    if variant == "json_schema":
        schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
        return SamplingParams(**common, grammar=json.dumps({"grammars": [{"json_schema": schema}]}))
    return SamplingParams(**common)


def _one_round(engine, variant: str, batch: int, max_tokens: int, round_no: int) -> tuple[float, int]:
    from overlap.engine.types import RequestSpec

    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(
            RequestSpec(f"{variant}-{round_no}-{i}", [1, 10 + i, 20 + i, 30], _sampling(variant, i, max_tokens))
        )
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return time.perf_counter() - start, tokens


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.engine.config import EngineConfig
    from overlap.engine.core import Engine
    from overlap.engine.model.builder import ensure_default_model

    torch.set_num_threads(args.threads)
    output_len = args.output_len or (32 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 3)
    model = args.model or str(ensure_default_model())
    blocks_each = -(-(output_len + 16) // 16)
    config = EngineConfig(model=model, max_num_seqs=args.batch, max_seq_len=output_len + 16,
                          num_kv_blocks=args.batch * blocks_each + 8, num_threads=args.threads)  # fmt: skip
    engine = Engine(config)
    _one_round(engine, "plain", min(args.batch, 8), 4, -1)  # warm-up (native kernel build, first allocations)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, int] = {}
    for r in range(rounds):
        for variant in VARIANTS:
            elapsed, n = _one_round(engine, variant, args.batch, output_len, r)
            times[variant].append(elapsed)
            tokens[variant] = n
            print(f"round {r + 1}/{rounds} {variant:12s} {n} tokens in {elapsed:.2f} s", file=sys.stderr, flush=True)
    per_token = {v: statistics.median(times[v]) / tokens[v] for v in VARIANTS}
    rows = [{"variant": v, "tokens": tokens[v], "median_s": statistics.median(times[v]),
             "us_per_token": per_token[v] * 1e6, "overhead_us_per_token": (per_token[v] - per_token["plain"]) * 1e6,
             "relative": per_token[v] / per_token["plain"]} for v in VARIANTS]  # fmt: skip
    if args.json:
        print(json.dumps({"batch": args.batch, "output_len": output_len, "rounds": rounds, "rows": rows}, indent=2))
        return 0
    print(f"\noverlap bench sampling: batch {args.batch}, {output_len} output tokens each, {rounds} interleaved "
          f"rounds, {args.threads} threads, model {model}")  # fmt: skip
    header = f"{'variant':12s} | {'tokens':>6s} | {'median s':>8s} | {'us/token':>8s} | {'overhead us/token':>17s}"
    print(header + " | vs plain")
    print("-" * 78)
    for row in rows:
        print(f"{row['variant']:12s} | {row['tokens']:6d} | {row['median_s']:8.2f} | {row['us_per_token']:8.1f} | "
              f"{row['overhead_us_per_token']:17.1f} | {row['relative']:.2f}x")  # fmt: skip
    return 0
