"""What `overlap bench quantized` and `overlap bench moe` share: their decode-step flags, checked the same way, and
the measurement of one decode step of a batch at a context."""

from __future__ import annotations

import statistics
import time


def add_decode_step_args(parser, rounds_help: str) -> None:
    """--batch-sizes, --rounds, --steps, --context, --threads and --json."""
    parser.add_argument("--batch-sizes", default="1,16,64", help="comma-separated (default 1,16,64)")
    parser.add_argument("--rounds", type=int, default=3, help=f"{rounds_help} (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per measurement (default 8)")
    parser.add_argument("--context", type=int, default=128, help="tokens already in each sequence (default 128)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")


def batch_sizes(args) -> list[int]:
    """--batch-sizes as integers; ConfigError for a bad one, or for any of the flags above below 1."""
    from overlap.engine.errors import ConfigError

    try:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated integers") from None
    if min(batches) < 1 or args.rounds < 1 or args.steps < 1 or args.context < 1:
        raise ConfigError("--batch-sizes, --rounds, --steps and --context must be >= 1")
    return batches


def decode_step(runner, batch: int, context: int, steps: int) -> float:
    """Seconds of the median of `steps` decode steps of `batch` sequences at `context` (after one warm-up)."""
    from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

    greedy = SamplingParams(temperature=0, ignore_eos=True)
    per_seq = -(-(context + steps + 2) // runner.block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    times = []
    for step in range(steps + 1):
        seqs = [ScheduledSeq(f"r{i}", [5 + i], context + step, tables[i], True, greedy, 1) for i in range(batch)]
        start = time.perf_counter()
        runner.execute(ModelInput(seqs))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
