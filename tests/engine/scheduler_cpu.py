"""Measure the scheduler's CPU time per step (no model: a constant-token runner), as a table.

    .venv/bin/python -m tests.engine.scheduler_cpu

Workload: 4 x batch requests of 128 prompt tokens and 64 output tokens (ignore EOS), block size 16, a KV pool the
size the CPU runner picks for the tiny model (2730 blocks), prefix caching on. `schedule()` is timed with
`time.thread_time()` (CPU time of this thread) on every step; steps that run a full batch of decodes are reported
separately from all steps (which include admissions with their block placement and prefill chunks).
"""

from __future__ import annotations

import statistics
import time

from overlap.engine import Engine, EngineConfig, RequestSpec, SamplingParams
from tests.support.engine import ConstantRunner, execute_now


def measure(batch: int) -> dict:
    engine = Engine(
        EngineConfig(max_seq_len=2048, max_num_seqs=batch), runner=ConstantRunner(num_kv_blocks=2730, block_size=16)
    )
    sampling = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(4 * batch):
        engine.add_request(RequestSpec(f"r{i}", [(i * 7 + j) % 60 + 2 for j in range(128)], sampling))
    all_steps, full_decode = [], []
    step_cpu = time.thread_time()
    num_steps = 0
    while engine.has_unfinished():
        outputs = engine._process_input(time.monotonic())
        batch_handle = engine.schedule()
        all_steps.append(batch_handle.schedule_cpu_s)
        seqs = batch_handle.model_input.seqs
        if len(seqs) == batch and all(len(s.token_ids) == 1 for s in seqs):
            full_decode.append(batch_handle.schedule_cpu_s)
        result = None if batch_handle.is_empty else execute_now(engine, batch_handle)
        outputs += engine.postprocess(batch_handle, result)
        num_steps += 1
    step_cpu = time.thread_time() - step_cpu
    us = 1e6
    return {
        "batch": batch,
        "steps": num_steps,
        "decode p50 us": statistics.median(full_decode) * us,
        "decode p99 us": sorted(full_decode)[int(0.99 * (len(full_decode) - 1))] * us,
        "all steps mean us": statistics.fmean(all_steps) * us,
        "engine step cpu us": step_cpu / num_steps * us,
    }


def main() -> None:
    rows = [measure(b) for b in (16, 64, 128)]
    headers = list(rows[0])
    print(" | ".join(f"{h:>18}" for h in headers))
    for row in rows:
        print(" | ".join(f"{row[h]:>18.0f}" if isinstance(row[h], float) else f"{row[h]:>18}" for h in headers))


if __name__ == "__main__":
    main()
