"""overlap bench lora: a batch of greedy requests through 1, 4 and 8 distinct LoRA adapters against the base model
alone, and the cost of switching an adapter into a device slot.

The adapters are written in PEFT's layout (adapter_config.json + adapter_model.safetensors; random A and B of rank
`--rank` on q, k, v, o, gate, up and down) into a temporary folder. Throughput: output tokens per second of a wave of
`--batch` requests (request i through adapter i mod N), the variants in alternating rounds in one engine, so their
ratios come from the same minutes of the same machine; the figure is the median over the rounds. Switch cost: the
time to fill a slot with an adapter read from its folder (cold) and with one already in host memory (warm).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = (0, 1, 4, 8)  # distinct adapters in the batch (0: the base model alone)


def add_parser(subparsers) -> None:
    from overlap.bench.model_args import add_model_arguments

    parser = subparsers.add_parser(
        "lora", help="a batch through 1, 4 and 8 LoRA adapters vs the base alone; the cost of switching adapters",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_model_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="16 output tokens, one round (seconds on the tiny model)")
    parser.add_argument("--batch", type=int, default=16, help="requests per wave (default 16)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request (default 64)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default 64; quick: 16)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 3; quick: 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--dtype", default="auto", help="default: the checkpoint's")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.set_defaults(func=run)


def _progress(message: str) -> None:
    print(f"[bench lora] {message}", file=sys.stderr, flush=True)


def write_adapters(spec, out: Path, count: int, rank: int, seed: int = 0) -> dict[str, str]:
    """`count` random adapters of `rank` on every projection, in PEFT's layout; name -> folder."""
    import torch
    from safetensors.torch import save_file

    from overlap.engine.model.lora import CONFIG_FILE, WEIGHTS_FILE, module_geometry

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    geometry = module_geometry(spec)
    gen = torch.Generator().manual_seed(seed)
    folders = {}
    for i in range(count):
        folder = out / f"adapter-{i}"
        folder.mkdir(parents=True)
        tensors = {}
        for layer in range(spec.num_layers):
            for module in modules:
                _, outputs, inputs = geometry[module]
                kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, rank, generator=gen) * 0.01
        save_file(tensors, str(folder / WEIGHTS_FILE))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}
        (folder / CONFIG_FILE).write_text(json.dumps(config))
        folders[f"adapter-{i}"] = str(folder)
    return folders


def _wave(engine, batch: int, adapters: list[str], prompt_len: int, output_len: int, vocab: int, seed: int) -> float:
    """Output tokens per second of one wave of `batch` requests, request i through adapters[i % len] (none: base)."""
    from overlap.engine.types import RequestSpec, SamplingParams

    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        name = adapters[i % len(adapters)] if adapters else None
        engine.add_request(RequestSpec(f"w{seed}-{i}", prompt, sampling, lora_name=name))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def _switch_costs(engine, name: str, path: str) -> dict[str, float]:
    """Seconds to fill slot 0 with the adapter: read from its folder (cold), then from host memory (warm)."""
    cache = engine.runner.lora
    cache.host.clear()
    start = time.perf_counter()
    cache.activate(0, name, path)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    cache.activate(0, name, path)
    return {"cold_s": cold, "warm_s": time.perf_counter() - start}


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.bench.model_args import model_folder
    from overlap.engine import Engine, EngineConfig
    from overlap.engine.model.builder import ensure_default_model
    from overlap.engine.model.model_spec import read_spec

    torch.set_num_threads(args.threads)
    output_len = args.output_len or (16 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 3)
    folder = model_folder(args, _progress) or str(ensure_default_model())
    spec = read_spec(Path(folder))
    with tempfile.TemporaryDirectory(prefix="overlap-bench-lora-") as tmp:
        adapters = write_adapters(spec, Path(tmp), max(VARIANTS), args.rank)
        config = EngineConfig(model=folder, dtype=args.dtype, num_threads=args.threads, enable_lora=True,
                              max_loras=max(VARIANTS), max_lora_rank=args.rank, lora_modules=adapters,
                              max_num_seqs=args.batch, max_seq_len=args.prompt_len + output_len + 1)  # fmt: skip
        _progress(f"engine on {folder} with {len(adapters)} adapters of rank {args.rank}")
        engine = Engine(config)
        try:
            names = list(adapters)
            _wave(engine, args.batch, names, args.prompt_len, output_len, spec.vocab_size, seed=-1)  # warm-up
            rates: dict[int, list[float]] = {n: [] for n in VARIANTS}
            for r in range(rounds):
                for n in VARIANTS:
                    rates[n].append(_wave(engine, args.batch, names[:n], args.prompt_len, output_len,
                                          spec.vocab_size, seed=r))  # fmt: skip
                _progress(f"round {r + 1}/{rounds} done")
            switch = _switch_costs(engine, names[0], adapters[names[0]])
        finally:
            engine.close()
    base = statistics.median(rates[0])
    rows = [{"adapters": n, "tok_s": statistics.median(rates[n]), "vs_base": statistics.median(rates[n]) / base}
            for n in VARIANTS]  # fmt: skip
    report = {"model": folder, "batch": args.batch, "rank": args.rank, "output_len": output_len, "rounds": rounds,
              "rows": rows, "switch": switch}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\noverlap bench lora: {folder}, batch {args.batch}, rank {args.rank}, {output_len} output tokens, greedy")
    print(f"{'adapters':>8s} | {'tok/s':>8s} | {'vs base':>7s}")
    for row in rows:
        print(f"{row['adapters'] or 'base':>8} | {row['tok_s']:8.1f} | {row['vs_base']:7.2f}")
    print(f"switch: {switch['cold_s'] * 1e3:.1f} ms from the folder, {switch['warm_s'] * 1e3:.1f} ms from host memory")
    return 0
