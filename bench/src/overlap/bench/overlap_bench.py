"""`overlap bench overlap`: how much device time the N-buffered pipeline wins back from host overhead.

On the simulated device (overlap.engine.model.sim_runner) a step takes `--step-ms` at batch `--batch` and the host
spends `--host-ms` of Python CPU time scheduling and staging each step (closed-loop decode workload,
overlap.bench.overlap_load).
For num_buffers 1, 2 and 3 it reports the device idle share measured from the device's busy intervals, the idle
share the arithmetic predicts from the two measured costs, and throughput; then the same with host time above
device time (where extra buffers cannot help); then the real tiny model on CPU with 1 and 2 buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

SPIKE_EVERY = 4


def cpu_reason(rows: list[dict]) -> str | None:
    """One line on why the tiny model's 1- vs 2-buffer rows on CPU came out as they did, from their figures."""
    by = {r["num_buffers"]: r for r in rows if r["device"] == "tiny model, CPU"}
    if 1 not in by or 2 not in by:
        return None
    one, two = by[1], by[2]
    if abs(two["device_ms_per_step"] / one["device_ms_per_step"] - 1) > 0.2:
        return (
            f"the forward itself took {one['device_ms_per_step']:.0f} ms/step on the engine thread and "
            f"{two['device_ms_per_step']:.0f} ms/step on the worker thread: on CPU the forward and the scheduler "
            "share the same two cores (and torch's OpenMP threads), so these rows measure core contention, not overlap"
        )
    share = one["host_ms_per_step"] / (one["host_ms_per_step"] + one["device_ms_per_step"])
    return (
        f"host time is {100 * share:.1f}% of a {one['device_ms_per_step']:.0f} ms CPU forward, so overlap can win "
        "back at most that, and on CPU the forward and the scheduler compete for the same two cores"
    )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "overlap",
        help="device idle share and throughput for num_buffers 1, 2, 3 (simulated device + tiny model on CPU)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps (finishes in under 60 s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (default 64)")
    parser.add_argument("--step-ms", type=float, default=4.0, help="simulated device step at --batch (default 4)")
    parser.add_argument("--per-token-us", type=float, default=10.0, help="simulated cost per token (default 10)")
    parser.add_argument("--profile", help="cost-model JSON ({fixed_s, per_token_s}) instead of --step-ms")
    parser.add_argument("--host-ms", type=float, default=1.5, help="host schedule+stage CPU per step (default 1.5)")
    parser.add_argument(
        "--cpu-bound-host-ms", type=float, default=6.0, help="host CPU per step for the host > device rows (default 6)"
    )
    parser.add_argument(
        "--spike-ms", type=float, default=7.0, help=f"host time of every {SPIKE_EVERY}th step in the spikes rows"
    )
    parser.add_argument("--steps", type=int, help="measured steps per simulated row (default 1500, quick 200)")
    parser.add_argument("--no-model", action="store_true", help="skip the real tiny model rows")
    parser.add_argument("--model-steps", type=int, help="measured steps per model row (default 40, quick 10)")
    parser.add_argument("--model-batch", type=int, default=64, help="sequences per step on the tiny model")
    parser.set_defaults(func=_run)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_simulated(args: argparse.Namespace) -> list[dict]:
    from overlap.bench.overlap_load import measure_overlap
    from overlap.engine.model.sim_runner import CostModel, SimRunner

    cost = (
        CostModel.load(args.profile)
        if args.profile
        else CostModel.for_step(args.step_ms, args.batch, args.per_token_us)
    )
    steps = args.steps or (200 if args.quick else 1500)
    max_tokens = 256
    blocks_per_request = -(-(8 + max_tokens) // 16)
    rows = []
    # (label, host ms, spike ms, asynchronous device). The asynchronous device is GPU-like: the engine thread
    # launches steps that run back to back on the device's own clock. The worker-thread rows run the CPU path's
    # pipeline (a worker thread calls the forward) on the same device.
    cases = (
        ("host < device", args.host_ms, None, True),
        ("host > device", args.cpu_bound_host_ms, None, True),
        (f"host spikes 1/{SPIKE_EVERY}", args.host_ms, args.spike_ms, True),
        ("host < device, worker thread", args.host_ms, None, False),
    )
    for label, host_ms, spike_ms, asynchronous in cases:
        for num_buffers in (1, 2, 3):
            _progress(f"  simulated device, {label}, num_buffers={num_buffers}: {steps} steps ...")
            runner = SimRunner(
                cost, num_kv_blocks=blocks_per_request * args.batch, eos_token_ids=(), asynchronous=asynchronous
            )
            result = measure_overlap(
                runner,
                num_buffers,
                batch=args.batch,
                steps=steps,
                host_ms=host_ms,
                spike_ms=spike_ms,
                spike_every=SPIKE_EVERY,
                max_tokens=max_tokens,
            )
            rows.append({"device": "simulated", "case": label, "host_ms_setting": host_ms, **asdict(result)})
    return rows


def measure_engine(runner, num_buffers: int, *, batch: int, steps: int, warmup_steps: int = 10) -> dict:
    """The real Engine (scheduler, block manager, postprocess) on `runner`, closed loop: `batch` requests run at
    once and each finished one is replaced. Host time = the engine's own scheduling and postprocessing."""
    import random

    from overlap.engine import Engine, EngineConfig, RequestSpec, SamplingParams
    from overlap.engine.execution.busy import BusyTracker

    config = EngineConfig(
        num_buffers=num_buffers, max_num_seqs=batch, max_num_batched_tokens=4096, max_seq_len=runner.max_model_len
    )
    engine = Engine(config, runner=runner)
    if not hasattr(engine, "executor"):
        raise RuntimeError("this Engine does not run its steps through the executor yet")
    rng = random.Random(0)
    counter = iter(range(10**9))

    def add() -> None:
        prompt = [rng.randrange(3, runner.vocab_size) for _ in range(16)]
        sampling = SamplingParams(max_tokens=rng.randint(64, 128), temperature=0, ignore_eos=True)
        engine.add_request(RequestSpec(f"r{next(counter)}", prompt, sampling))

    def run(num_steps: int) -> int:
        tokens = 0
        for _ in range(num_steps):
            for out in engine.step():
                tokens += len(out.new_token_ids)
                if out.finished:
                    add()
        return tokens

    # Host time = the engine thread's time minus what it spent waiting for the device (collect) or running it
    # (submit, which runs the forward inline with one buffer).
    executor = engine.executor
    waited = [0.0]

    def timed(method):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                waited[0] += time.perf_counter() - t0

        return wrapper

    executor.collect = timed(executor.collect)
    if num_buffers == 1:
        executor.submit = timed(executor.submit)
    for _ in range(batch):
        add()
    run(warmup_steps)
    executor.busy = BusyTracker(window_s=float("inf"))
    waited[0] = 0.0
    start = time.perf_counter()
    tokens = run(steps)
    elapsed = time.perf_counter() - start
    snap = executor.busy.snapshot()
    engine.close()
    host_ms = 1000 * (elapsed - waited[0]) / steps
    device_ms = 1000 * snap.busy_s / max(snap.num_steps, 1)
    from overlap.bench.overlap_load import predicted_idle_share

    return {
        "num_buffers": num_buffers,
        "num_steps": steps,
        "host_ms_per_step": host_ms,
        "device_ms_per_step": device_ms,
        "idle_share": 1 - snap.busy_ratio,
        "predicted_idle_share": predicted_idle_share(num_buffers, [host_ms / 1000] * steps, device_ms / 1000),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "idle_gap_p50_ms": snap.idle_gap_ms["p50"],
        "idle_gap_p99_ms": snap.idle_gap_ms["p99"],
    }


def run_engine_simulated(args: argparse.Namespace) -> tuple[list[dict], str | None]:
    """The real engine's own host time against the simulated device; (rows, reason skipped or None)."""
    from overlap.engine.model.sim_runner import CostModel, SimRunner

    cost = (
        CostModel.load(args.profile)
        if args.profile
        else CostModel.for_step(args.step_ms, args.batch, args.per_token_us)
    )
    steps = args.steps or (200 if args.quick else 1500)
    rows = []
    for num_buffers in (1, 2, 3):
        _progress(f"  engine on the simulated device, num_buffers={num_buffers}: {steps} steps ...")
        runner = SimRunner(
            cost, num_kv_blocks=9 * args.batch * 2, max_model_len=1024, eos_token_ids=(), asynchronous=True
        )
        try:
            result = measure_engine(runner, num_buffers, batch=args.batch, steps=steps)
        except RuntimeError as exc:
            return [], str(exc)
        rows.append({"device": "simulated", "case": "real engine host", "host_ms_setting": None, **result})
    return rows, None


def run_tiny_model(args: argparse.Namespace) -> tuple[list[dict], str | None]:
    """The real model runner on CPU; (rows, reason it was skipped or None)."""
    try:
        from overlap.engine.config import EngineConfig
        from overlap.engine.model.builder import ensure_default_model
        from overlap.engine.model.runner import ModelRunner
    except ImportError as exc:
        return [], f"model runner not available ({exc})"
    from overlap.bench.overlap_load import measure_overlap

    steps = args.model_steps or (10 if args.quick else 40)
    batch, prompt_len, max_tokens = args.model_batch, 16, 128  # no request finishes within the measured steps
    blocks = -(-(prompt_len + max_tokens) // 16) * batch + 8
    config = EngineConfig(num_threads=2, num_kv_blocks=blocks, max_num_seqs=batch, block_size=16)
    runner = ModelRunner(config, ensure_default_model())
    rows = []
    for num_buffers in (1, 2):
        _progress(f"  tiny model on CPU, num_buffers={num_buffers}: {steps} steps ...")
        result = measure_overlap(
            runner,
            num_buffers,
            batch=batch,
            steps=steps,
            host_ms=args.host_ms,
            warmup_steps=4,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
        )
        rows.append(
            {"device": "tiny model, CPU", "case": "real forward", "host_ms_setting": args.host_ms, **asdict(result)}
        )
    return rows, None


def _run(args: argparse.Namespace) -> int:
    from overlap.engine.errors import ConfigError

    if args.batch < 1 or args.model_batch < 1 or args.host_ms < 0 or args.cpu_bound_host_ms < 0:
        raise ConfigError("--batch and --model-batch must be >= 1, host times >= 0")
    if (args.steps is not None and args.steps < 10) or (args.model_steps is not None and args.model_steps < 2):
        raise ConfigError("--steps must be >= 10 and --model-steps >= 2")
    started = time.perf_counter()
    _progress("overlap bench: simulated device")
    rows = run_simulated(args)
    engine_rows, engine_skipped = run_engine_simulated(args)
    rows += engine_rows
    skipped = None
    if args.no_model:
        skipped = "--no-model"
    else:
        _progress("overlap bench: tiny model on CPU")
        model_rows, skipped = run_tiny_model(args)
        rows += model_rows
    _add_speedups(rows)
    if args.json:
        print(
            json.dumps(
                {
                    "rows": rows,
                    "tiny_model_skipped": skipped,
                    "engine_rows_skipped": engine_skipped,
                    "cpu_reason": cpu_reason(rows),
                    "load_average": os.getloadavg()[0],
                    "num_cores": os.cpu_count(),
                    "elapsed_s": time.perf_counter() - started,
                },
                indent=2,
            )
        )
        return 0
    print(format_table(rows, args))
    if engine_skipped:
        print(f"engine rows skipped: {engine_skipped}")
    if skipped:
        print(f"tiny model rows skipped: {skipped}")
    else:
        print(f"tiny model on CPU: {cpu_reason(rows)}")
    load = os.getloadavg()[0]
    print(
        f"({time.perf_counter() - started:.0f} s; load average {load:.1f} on {os.cpu_count()} cores: other processes "
        "delay the threads' wake-ups, which shows as idle the prediction does not have)"
    )
    return 0


def _add_speedups(rows: list[dict]) -> None:
    base: dict[tuple[str, str], float] = {}
    for row in rows:
        key = (row["device"], row["case"])
        if row["num_buffers"] == 1:
            base[key] = row["tokens_per_s"]
        row["speedup_vs_1"] = row["tokens_per_s"] / base[key] if base.get(key) else None


def format_table(rows: list[dict], args: argparse.Namespace) -> str:
    header = (
        f"Overlap: device idle share by num_buffers (simulated step {args.step_ms:g} ms at batch {args.batch}, "
        f"host {args.host_ms:g} ms / {args.cpu_bound_host_ms:g} ms per step, spikes: every {SPIKE_EVERY}th step "
        f"{args.spike_ms:g} ms)"
    )
    columns = (
        "device",
        "case",
        "buffers",
        "host ms/step",
        "device ms/step",
        "idle %",
        "predicted idle %",
        "gap p50/p99 ms",
        "tokens/s",
        "vs 1 buffer",
    )
    lines = [
        [
            row["device"],
            row["case"],
            str(row["num_buffers"]),
            f"{row['host_ms_per_step']:.2f}",
            f"{row['device_ms_per_step']:.2f}",
            f"{100 * row['idle_share']:.1f}",
            f"{max(0.0, 100 * row['predicted_idle_share']):.1f}",
            f"{row['idle_gap_p50_ms']:.2f}/{row['idle_gap_p99_ms']:.2f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['speedup_vs_1']:.2f}x" if row["speedup_vs_1"] else "-",
        ]
        for row in rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(columns)]
    out = [header, "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in lines]
    out.append(
        "idle % = 1 - device busy time / elapsed, from the device's own busy intervals; predicted = an ideal pipeline "
        "fed the measured host and device times (host/(host+device) with 1 buffer, 1 - device/max(host, device) with "
        "more when host time is even)"
    )
    return "\n".join(out)
