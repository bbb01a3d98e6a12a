"""An offline workload through the engine with 1 and 2 buffers in alternating rounds: output tokens/s and the median
decode step of each (docs/overlap.md, "On a CPU: one buffer by default").

    python bench/engine_buffers.py --model-shape qwen3-30b-a3b --layers 4
    python bench/engine_buffers.py --model FOLDER --num-buffers 1,2 --rounds 2 --requests 128 --batch 64

Each run builds an Engine on the folder (bf16, 2 threads), adds the requests (random prompts, greedy, EOS ignored)
and steps until they finish; a step that adds no prompt tokens counts as a decode step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def run(folder: str, num_buffers: int, requests: int, batch: int, prompt_len: int, output_len: int,
        threads: int) -> tuple[float, float]:  # fmt: skip
    """(output tokens/s, median decode step in seconds) of one run."""
    import torch

    from overlap.engine import Engine, EngineConfig
    from overlap.engine.types import RequestSpec, SamplingParams

    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=folder, dtype="bfloat16", num_threads=threads, max_num_seqs=batch,
                                 num_buffers=num_buffers))  # fmt: skip
    try:
        rng = random.Random(0)
        sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        vocab = engine.vocab_size
        for i in range(requests):
            engine.add_request(RequestSpec(f"r{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], sampling))
        start, tokens, decode_steps, prompt_total = time.perf_counter(), 0, [], 0
        while engine.has_unfinished():
            step_start = time.perf_counter()
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            elapsed, prompts = time.perf_counter() - step_start, engine.stats()["num_prompt_tokens_total"]
            if prompts == prompt_total:
                decode_steps.append(elapsed)
            prompt_total = prompts
        return tokens / (time.perf_counter() - start), statistics.median(decode_steps)
    finally:
        engine.close()


def _progress(message: str) -> None:
    print(f"[engine_buffers] {message}", file=sys.stderr, flush=True)


def main() -> int:
    from overlap.engine.model.shapes import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a model folder")
    where.add_argument("--model-shape", choices=list(SHAPES),
                       help="a real family's shape with random weights (overlap model build-shape)")  # fmt: skip
    parser.add_argument("--layers", type=int, help="with --model-shape: keep the first N decoder layers")
    parser.add_argument("--num-buffers", default="1,2", help="comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--requests", type=int, default=128, help="requests a run (default 128)")
    parser.add_argument("--batch", type=int, default=64, help="max_num_seqs (default 64)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args()
    folder = args.model
    if folder is None:
        from overlap.engine.model.shapes import ensure_shape_model

        folder = str(ensure_shape_model(args.model_shape, progress=_progress, layers=args.layers))
    buffers = [int(n) for n in args.num_buffers.split(",")]
    results: dict[int, list[tuple[float, float]]] = {n: [] for n in buffers}
    for r in range(args.rounds):
        for n in buffers if r % 2 == 0 else reversed(buffers):
            _progress(f"round {r + 1}/{args.rounds}, {n} buffer(s) ...")
            results[n].append(run(folder, n, args.requests, args.batch, args.prompt_len, args.output_len, args.threads))
    print(
        f"\n{folder}: {args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
        f"{args.batch} at once, bf16, {args.threads} threads"
    )
    print(f"{'buffers':>7} | {'tok/s (rounds)':>28} | {'median decode step (rounds)':>30}")
    for n, runs in results.items():
        rates = ", ".join(f"{rate:.1f}" for rate, _ in runs)
        steps = ", ".join(f"{step * 1e3:.0f} ms" for _, step in runs)
        print(f"{n:>7} | {rates:>28} | {steps:>30}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
