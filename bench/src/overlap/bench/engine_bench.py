"""`overlap bench engine`: the model runner's ceiling, the engine's offline throughput against it, and what the paged
KV layout costs versus a contiguous cache. Tiny default model, fp32, 2 threads unless told otherwise; `--model-shape`
measures a real family's shape with random weights (`overlap model build-shape`).

Figures (all measured in this one process, so their ratios are comparable on a shared, noisy machine):
  decode ceiling     the runner alone, decode steps at batch B (context in the workload's range), tokens/s
  step / floor       that decode step's time over its physical floor, the longer of the bytes it must read
                     (weights once, the K/V at its context) over the memory read bandwidth and its FLOPs over the
                     matmul peak, both measured in this process (bench/floor.py)
  workload ceiling   the runner alone on the whole offline workload in static waves of B requests (prefill, then
                     decode), output tokens/s: the best an engine could do with that runner at that batch size
  engine             Engine.step() over the same workload (max_num_seqs = B), output tokens/s
  engine/ceiling     engine / workload ceiling; "busy" is the runner's forward time / engine wall time
  sched ms/step      CPU time of Scheduler.schedule() per engine step
  paged vs contig    decode step time with the paged pool (block runs, as the block manager hands out), the paged
                     pool with every block table scattered (the gather path), and a contiguous per-sequence cache
                     read by one batched attention call per layer; at --dtype bfloat16 also the fp32 paged step,
                     interleaved with the others, and the bf16 / fp32 step ratio
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from overlap.bench.floor import (
    cpu_int8_matmul_peak,
    cpu_matmul_peak,
    cpu_read_bandwidth,
    decode_compute_floor,
    decode_floor_bytes,
)
from overlap.bench.model_args import add_model_arguments, model_folder
from overlap.engine.config import CPU_STEP_PLANS

FULL = dict(batch_sizes=(1, 16, 64, 128), num_requests=256, prompt_len=128, output_len=64)
# Batch 1 runs its requests one after another, so its throughput does not depend on how many there are: 16 give the
# same figure as 256 in 1/16 of the time (unless --num-requests is given).
BATCH1_REQUESTS = 16
QUICK = dict(batch_sizes=(16, 64), num_requests=64, prompt_len=64, output_len=16)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "engine",
        help="runner ceiling vs engine throughput, paged vs contiguous KV, start-up time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 requests x 64 prompt x 16 output tokens at batch 16 and 64, under 60 s"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    add_model_arguments(parser)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--cpu-step-plan", default="auto", choices=CPU_STEP_PLANS,
                        help="how a CPU step uses its threads (EngineConfig.cpu_step_plan; default auto)")  # fmt: skip
    parser.add_argument("--batch-sizes", help="comma-separated batch sizes (default 1,16,64,128; quick: 16,64)")
    parser.add_argument("--num-requests", type=int, help="requests in the offline workload (default 256)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per request (default 128)")
    parser.add_argument("--output-len", type=int, help="output tokens per request, EOS ignored (default 64)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from overlap.engine.errors import ConfigError
    from overlap.engine.model.builder import ensure_default_model

    plan = dict(QUICK if args.quick else FULL)
    if args.batch_sizes:
        try:
            plan["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
        except ValueError:
            raise ConfigError(f"--batch-sizes {args.batch_sizes!r}: expected comma-separated integers") from None
    for key in ("num_requests", "prompt_len", "output_len"):
        if getattr(args, key) is not None:
            plan[key] = getattr(args, key)
    sizes = {"--threads": args.threads, "--batch-sizes": min(plan["batch_sizes"]),
             "--num-requests": plan["num_requests"], "--prompt-len": plan["prompt_len"],
             "--output-len": plan["output_len"]}  # fmt: skip
    if bad := [f"{name} {value}" for name, value in sizes.items() if value < 1]:
        raise ConfigError(f"{', '.join(bad)}: must be >= 1")
    batch1_requests = args.num_requests if args.num_requests is not None else min(plan["num_requests"], BATCH1_REQUESTS)
    torch.set_num_threads(args.threads)
    model_dir = model_folder(args, _progress) or str(ensure_default_model())
    bench = EngineBench(model_dir, args.dtype, args.threads, **plan, step_plan=args.cpu_step_plan)

    started = time.perf_counter()
    bench.bandwidth = cpu_read_bandwidth()
    bench.peak = cpu_matmul_peak(getattr(torch, args.dtype))
    # W8A8's projections run at the int8 instruction's rate: their floor is taken at its measured peak
    bench.int8_peak = cpu_int8_matmul_peak() if args.quantization == "w8a8" else 0.0
    int8 = f", int8 matmul peak {bench.int8_peak / 1e9:.0f} GOP/s" if bench.int8_peak else ""
    _progress(f"memory read bandwidth {bench.bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul peak "
              f"{bench.peak / 1e9:.0f} GFLOP/s{int8} ({args.threads} threads)")  # fmt: skip
    results = {"setup": {**plan, "model": model_dir, "model_shape": args.model_shape, "dtype": args.dtype,
                         "threads": args.threads, "read_bandwidth_gb_s": bench.bandwidth / 1e9,
                         "matmul_peak_gflop_s": bench.peak / 1e9,
                         "int8_peak_gop_s": bench.int8_peak / 1e9}}  # fmt: skip
    results["startup"] = bench.startup()
    results["setup"]["kernels"] = results["startup"].pop("kernels")
    results["rows"] = []
    for batch in plan["batch_sizes"]:
        bench.num_requests = batch1_requests if batch == 1 else plan["num_requests"]
        row = {"batch": batch, "num_requests": bench.num_requests}
        row.update(bench.decode_ceiling(batch))
        row.update(bench.workload_ceiling(batch))
        row.update(bench.engine_run(batch))
        row["engine_over_ceiling"] = row["engine_tok_s"] / row["workload_ceiling_tok_s"]
        # The same ratio in CPU seconds for the same work: barely moved by other processes taking the cores.
        row["engine_over_ceiling_cpu"] = row["workload_ceiling_cpu_s"] / row["engine_cpu_s"]
        results["rows"].append(row)
        _progress(f"batch {batch}: done ({time.perf_counter() - started:.0f} s so far)")
    paged_batches = [b for b in plan["batch_sizes"] if b >= 64] or [max(plan["batch_sizes"])]
    repeats = 12 if args.quick else 20
    results["paged_vs_contiguous"] = [bench.paged_vs_contiguous(b, repeats) for b in paged_batches]
    results["total_s"] = time.perf_counter() - started
    print(json.dumps(results, indent=2) if args.json else _table(results))
    return 0


def _progress(message: str) -> None:
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)


class EngineBench:
    def __init__(self, model_dir, dtype, threads, batch_sizes, num_requests, prompt_len, output_len,
                 step_plan: str = "auto") -> None:  # fmt: skip
        self.model_dir = model_dir
        self.dtype = dtype
        self.threads = threads
        self.num_requests = num_requests
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.max_seq_len = prompt_len + output_len
        self.step_plan = step_plan  # EngineConfig.cpu_step_plan
        self.bandwidth = 0.0  # bytes/s and FLOP/s the decode floors are computed with (measured by run())
        self.peak = 0.0
        self.int8_peak = 0.0  # OP/s of the int8 matmul, for a W8A8 model's projections; 0: everything at `peak`
        rng = random.Random(0)
        # Distinct random prompts: no prefix-cache hits flatter the engine.
        self.prompts = [[rng.randrange(3, 8000) for _ in range(prompt_len)] for _ in range(num_requests)]

    def _config(self, batch: int, **overrides):
        from overlap.engine.config import EngineConfig

        blocks_per_seq = -(-self.max_seq_len // 16)
        fields = dict(
            model=self.model_dir,
            dtype=self.dtype,
            num_threads=self.threads,
            max_seq_len=self.max_seq_len,
            max_num_seqs=batch,
            max_num_batched_tokens=max(2048, self.prompt_len),
            num_kv_blocks=batch * blocks_per_seq + 16,
            cpu_step_plan=self.step_plan,
        )
        fields.update(overrides)
        return EngineConfig(**fields)

    def _runner(self, batch: int, **overrides):
        from pathlib import Path

        from overlap.engine.model.runner import ModelRunner

        return ModelRunner(self._config(batch, **overrides), Path(self.model_dir))

    # ---- start-up -----------------------------------------------------------------------------------------------
    def startup(self) -> dict:
        """Seconds to a ready engine: in this process (model load + KV pool), and in a fresh process (imports too);
        and the kernels that engine's runner picked."""
        from overlap.engine.core import Engine

        t0 = time.perf_counter()
        engine = Engine(self._config(64))
        in_process = time.perf_counter() - t0
        kernels = engine.runner.kernels
        _progress(f"kernels: {kernels}")
        engine.close()
        code = (
            "import time; t = time.perf_counter(); import torch;"
            "from overlap.engine.config import EngineConfig; from overlap.engine.core import Engine;"
            f"Engine(EngineConfig(model={self.model_dir!r}, max_seq_len={self.max_seq_len}, max_num_seqs=64,"
            f" num_threads={self.threads})); print(time.perf_counter() - t)"
        )
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        fresh_total = time.perf_counter() - t0
        _progress(f"start-up: {in_process:.2f} s in process, {fresh_total:.2f} s in a fresh process")
        return {
            "kernels": kernels,
            "engine_init_s": in_process,
            "fresh_process_s": fresh_total,
            "fresh_import_and_init_s": float(out.stdout),
        }

    # ---- the runner alone ---------------------------------------------------------------------------------------
    def _decode_inputs(self, runner, batch: int, context: int, scatter: bool = False):
        """Decode ModelInputs for `batch` sequences at position `context`, their K/V filled with random values."""
        import torch

        from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

        per_seq = -(-self.max_seq_len // runner.block_size)
        ids = list(range(batch * per_seq))
        if scatter:
            random.Random(1).shuffle(ids)
        tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
        with torch.inference_mode():  # the pools are inference tensors
            runner.k_pool[:, : batch * per_seq * runner.block_size].normal_(0, 1)
            runner.v_pool[:, : batch * per_seq * runner.block_size].normal_(0, 1)
            if runner.kv_split is not None:  # the sliding layers' pool: these tables' block b is its b + 1
                for pool in (runner.window_k_pool, runner.window_v_pool):
                    pool[:, runner.block_size : (batch * per_seq + 1) * runner.block_size].normal_(0, 1)
        greedy = SamplingParams(temperature=0, max_tokens=self.output_len, ignore_eos=True)

        def step_input(pos: int):
            return ModelInput([ScheduledSeq(f"r{i}", [5 + i], pos, tables[i], True, greedy, 1) for i in range(batch)])

        return step_input

    def decode_ceiling(self, batch: int) -> dict:
        """Decode steps of the runner alone at batch `batch`, over the workload's contexts, against their floor."""
        runner = self._runner(batch)
        step_input = self._decode_inputs(runner, batch, self.prompt_len)
        steps = max(4, min(self.output_len, 2048 // batch))
        positions = [self.prompt_len + (self.output_len * i) // steps for i in range(steps)]
        runner.execute(step_input(positions[0]))  # warm-up
        t0 = time.perf_counter()
        for pos in positions:
            runner.execute(step_input(pos))
        elapsed = time.perf_counter() - t0
        step_s = elapsed / steps
        context = sum(positions) / steps
        memory_s = decode_floor_bytes(runner, batch, context) / self.bandwidth
        compute_s = decode_compute_floor(runner, batch, context, self.peak, self.int8_peak)
        floor_s = max(memory_s, compute_s)
        bound = "memory" if memory_s >= compute_s else "compute"
        _progress(f"batch {batch}: decode ceiling {batch / step_s:.0f} tok/s, step {1000 * step_s:.1f} ms, "
                  f"floor {1000 * floor_s:.1f} ms ({bound}; {step_s / floor_s:.2f}x)")  # fmt: skip
        return {"decode_ceiling_tok_s": batch / step_s, "decode_step_ms": 1000 * step_s,
                "decode_memory_floor_ms": 1000 * memory_s, "decode_compute_floor_ms": 1000 * compute_s,
                "decode_floor_ms": 1000 * floor_s, "decode_bound": bound,
                "decode_step_over_floor": step_s / floor_s}  # fmt: skip

    def workload_ceiling(self, batch: int) -> dict:
        """The runner alone on the offline workload, in static waves: prefill a wave's prompts (packed up to the
        token budget), then decode it to the end. No scheduler, no bookkeeping."""
        from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

        runner = self._runner(batch)
        budget = self._config(batch).max_num_batched_tokens
        greedy = SamplingParams(temperature=0, max_tokens=self.output_len, ignore_eos=True)
        per_seq = -(-self.max_seq_len // runner.block_size)
        num_out = 0
        c0, t0 = time.process_time(), time.perf_counter()
        for wave_start in range(0, self.num_requests, batch):
            wave = self.prompts[wave_start : min(wave_start + batch, self.num_requests)]
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(wave))]
            last = [0] * len(wave)
            for first in range(0, len(wave), max(1, budget // self.prompt_len)):
                group = range(first, min(len(wave), first + max(1, budget // self.prompt_len)))
                seqs = [ScheduledSeq(f"r{i}", wave[i], 0, tables[i], True, greedy, 0) for i in group]
                for i, token in zip(group, runner.execute(ModelInput(seqs)).token_ids, strict=True):
                    last[i] = token
            for step in range(1, self.output_len):
                seqs = [
                    ScheduledSeq(f"r{i}", [last[i]], self.prompt_len + step - 1, tables[i], True, greedy, step)
                    for i in range(len(wave))
                ]
                last = runner.execute(ModelInput(seqs)).token_ids
            num_out += len(wave) * self.output_len
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        _progress(f"batch {batch}: workload ceiling {num_out / elapsed:.0f} tok/s")
        return {
            "workload_ceiling_tok_s": num_out / elapsed,
            "workload_ceiling_s": elapsed,
            "workload_ceiling_cpu_s": cpu,
        }

    # ---- the engine ---------------------------------------------------------------------------------------------
    def engine_run(self, batch: int) -> dict:
        from overlap.engine.core import Engine
        from overlap.engine.types import RequestSpec, SamplingParams

        engine = Engine(self._config(batch))
        scheduler = engine.scheduler
        schedule = scheduler.schedule
        sched_cpu = [0.0]

        def timed_schedule(*a, **kw):  # CPU time of the scheduling decision alone
            c0 = time.thread_time()
            try:
                return schedule(*a, **kw)
            finally:
                sched_cpu[0] += time.thread_time() - c0

        scheduler.schedule = timed_schedule
        busy = engine.executor.busy
        greedy = SamplingParams(temperature=0, max_tokens=self.output_len, ignore_eos=True)
        for i, prompt in enumerate(self.prompts[: self.num_requests]):
            engine.add_request(RequestSpec(f"req-{i}", prompt, greedy))
        num_out = num_steps = 0
        busy_s0 = busy.busy_s_total
        c0, t0 = time.process_time(), time.perf_counter()
        while engine.has_unfinished():
            outputs = engine.step()
            num_steps += 1
            num_out += sum(len(o.new_token_ids) for o in outputs)
        forward_s = busy.busy_s_total - busy_s0
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        engine.close()
        expected = self.num_requests * self.output_len
        if num_out != expected:
            raise RuntimeError(f"engine produced {num_out} tokens, expected {expected}")
        _progress(f"batch {batch}: engine {num_out / elapsed:.0f} tok/s")
        return {
            "engine_tok_s": num_out / elapsed,
            "engine_s": elapsed,
            "engine_cpu_s": cpu,
            "engine_steps": num_steps,
            "engine_busy": forward_s / elapsed,
            "sched_ms_per_step": sched_cpu[0] / max(num_steps, 1) * 1e3,
        }

    # ---- paged vs contiguous ------------------------------------------------------------------------------------
    def paged_vs_contiguous(self, batch: int, repeats: int) -> dict:
        paged = self._runner(batch)
        # One copy of the weights and the pool (equally warm in the CPU caches for every case): sequence i's K/V lie
        # in slots [i * Lmax, (i + 1) * Lmax) in both the paged runs case and the contiguous one.
        contiguous = _contiguous_runner(paged, self.max_seq_len)
        runs_input = self._decode_inputs(paged, batch, self.prompt_len)
        scattered_input = self._decode_inputs(paged, batch, self.prompt_len, scatter=True)
        pos = self.prompt_len + self.output_len // 2
        cases = {
            "paged_runs": (paged, runs_input(pos)),
            "paged_scattered": (paged, scattered_input(pos)),
            "contiguous": (contiguous, runs_input(pos)),
        }
        if self.dtype != "float32":  # the same step in fp32, in the same interleaved repeats: a ratio load can't skew
            fp32 = self._runner(batch, dtype="float32")
            cases["paged_fp32"] = (fp32, self._decode_inputs(fp32, batch, self.prompt_len)(pos))
        times: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for runner, model_input in cases.values():
            runner.execute(model_input)  # warm-up
        order = list(cases)
        shuffle = random.Random(2).shuffle
        for _ in range(repeats):  # interleaved in a shuffled order, so load changes hit every case alike
            shuffle(order)
            for name in order:
                runner, model_input = cases[name]
                c0, t0 = time.process_time(), time.perf_counter()
                runner.execute(model_input)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        # The minimum is the least disturbed run (other processes only ever add time); the median is shown too.
        best = {name: min(t) for name, t in times.items()}
        med = {name: statistics.median(t) for name, t in times.items()}
        cpu_med = {name: statistics.median(t) for name, t in cpu.items()}
        _progress(
            f"batch {batch}: paged {best['paged_runs'] * 1e3:.1f} ms vs contiguous {best['contiguous'] * 1e3:.1f}"
        )
        versus_fp32 = {}
        if "paged_fp32" in best:
            versus_fp32 = {
                "over_fp32": best["paged_runs"] / best["paged_fp32"],
                "over_fp32_median": med["paged_runs"] / med["paged_fp32"],
            }
        return {
            "batch": batch,
            "context": pos,
            "repeats": repeats,
            **{f"{name}_ms": value * 1e3 for name, value in best.items()},
            **{f"{name}_median_ms": value * 1e3 for name, value in med.items()},
            "paged_runs_overhead": best["paged_runs"] / best["contiguous"] - 1,
            "paged_runs_overhead_median": med["paged_runs"] / med["contiguous"] - 1,
            "paged_scattered_overhead": best["paged_scattered"] / best["contiguous"] - 1,
            **{f"{name}_cpu_ms": value * 1e3 for name, value in cpu_med.items()},
            "paged_runs_overhead_cpu": cpu_med["paged_runs"] / cpu_med["contiguous"] - 1,
            **versus_fp32,
        }


def _contiguous_runner(paged, max_seq_len: int):
    """`paged` with its decode attention reading a contiguous per-sequence cache: sequence i owns slots
    [i * Lmax, (i + 1) * Lmax) of each layer's pool, viewed as [batch, Lmax, heads, D] and read by one batched
    scaled_dot_product_attention per layer with a length mask (the layout of a static, non-paged cache). It shares
    the paged runner's weights and pool (shallow copies)."""
    import copy

    import torch
    import torch.nn.functional as F

    from overlap.engine.model.layers.attention import PagedAttention

    lmax = paged.block_size * -(-max_seq_len // paged.block_size)

    class ContiguousAttention(PagedAttention):
        def _torch(self, q, k_pool, v_pool, seqs, sinks=None):
            # seqs may be one half of the step (the runner cuts a CPU batch in two): start at its first slot.
            assert sinks is None, "the contiguous reference has no attention sinks"
            num, first = len(seqs), seqs[0].kv_start
            assert all(s.q_len == 1 and s.kv_start == first + i * lmax for i, s in enumerate(seqs)), "decode-only"
            lengths = torch.tensor([s.kv_len for s in seqs])
            mask = (torch.arange(lmax).unsqueeze(0) < lengths.unsqueeze(1)).view(num, 1, 1, lmax)
            k = k_pool[first : first + num * lmax].view(num, lmax, *k_pool.shape[1:]).transpose(1, 2)
            v = v_pool[first : first + num * lmax].view(num, lmax, *v_pool.shape[1:]).transpose(1, 2)
            out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=self.gqa)
            return out.reshape(num, -1)

    spec = paged.spec
    runner = copy.copy(paged)
    # no decode kernel: every decode goes through _torch, overridden above
    runner.attention = ContiguousAttention(heads=spec.num_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                           block_size=paged.block_size, dtype=paged.dtype, decode_kernel=None,
                                           triton=None, cpu_paths=True, helper=paged.helper)  # fmt: skip
    runner.model = copy.copy(paged.model)
    runner.model.attention = runner.attention
    runner.packer = copy.copy(paged.packer)
    runner.packer.use_decode_kernel = False
    return runner


def _table(results: dict) -> str:
    setup = results["setup"]
    int8 = setup.get("int8_peak_gop_s")
    int8 = f", int8 matmul peak {int8:.0f} GOP/s (W8A8's projections)" if int8 else ""
    lines = [
        f"overlap bench engine: {setup['num_requests']} requests (reqs column) x {setup['prompt_len']} prompt x "
        f"{setup['output_len']} output tokens (EOS ignored), {setup['dtype']}, {setup['threads']} threads",
        f"kernels: {setup['kernels']}",
        f"memory read bandwidth {setup['read_bandwidth_gb_s']:.1f} GB/s, {setup['dtype']} matmul peak "
        f"{setup['matmul_peak_gflop_s']:.0f} GFLOP/s{int8} (the decode floor's denominators)",
        "",
        f"{'batch':>5} | {'reqs':>4} | {'decode ceiling':>14} | {'workload ceiling':>16} | {'engine':>9} | "
        f"{'engine/ceiling':>14} "
        f"| {'(CPU s)':>7} | {'busy':>5} | {'sched ms/step':>13} | {'steps':>6}",
        f"{'':>5} | {'':>4} | {'tok/s':>14} | {'out tok/s':>16} | {'out tok/s':>9} | {'':>14} | {'':>7} | {'':>5} | "
        f"{'':>13} "
        f"| {'':>6}",
        "-" * 121,
    ]
    floors = [f"{'batch':>5} | {'decode step':>11} | {'memory floor':>12} | {'compute floor':>13} | "
              f"{'step / floor':>12} | bound", "-" * 76]  # fmt: skip
    for r in results["rows"]:
        floors.append(f"{r['batch']:>5} | {r['decode_step_ms']:>8.1f} ms | {r['decode_memory_floor_ms']:>9.1f} ms | "
                      f"{r['decode_compute_floor_ms']:>10.1f} ms | {r['decode_step_over_floor']:>12.2f} | "
                      f"{r['decode_bound']}")  # fmt: skip
    for r in results["rows"]:
        lines.append(
            f"{r['batch']:>5} | {r['num_requests']:>4} | {r['decode_ceiling_tok_s']:>14.0f} | "
            f"{r['workload_ceiling_tok_s']:>16.0f} | "
            f"{r['engine_tok_s']:>9.0f} | {r['engine_over_ceiling']:>14.0%} | {r['engine_over_ceiling_cpu']:>7.0%} | "
            f"{r['engine_busy']:>5.0%} | "
            f"{r['sched_ms_per_step']:>13.3f} | {r['engine_steps']:>6}"
        )
    lines += ["", "The decode step against its floor (the longer of bytes / read bandwidth and FLOPs / matmul peak):",
              *floors]  # fmt: skip
    lines += [
        "",
        "KV layout, one decode step (wall: fastest of the interleaved repeats; paged cost also from median wall and",
        "median CPU time, which other processes barely move):",
        f"{'batch':>5} | {'context':>7} | {'paged (runs)':>12} | {'paged (scattered)':>17} | {'contiguous':>10} | "
        f"{'paged cost':>10} | {'(median)':>8} | {'(CPU)':>6} | {'scattered cost':>14}",
        "-" * 115,
    ]
    for p in results["paged_vs_contiguous"]:
        lines.append(
            f"{p['batch']:>5} | {p['context']:>7} | {p['paged_runs_ms']:>9.1f} ms | "
            f"{p['paged_scattered_ms']:>14.1f} ms | {p['contiguous_ms']:>7.1f} ms | "
            f"{p['paged_runs_overhead']:>+10.1%} | {p['paged_runs_overhead_median']:>+8.1%} | "
            f"{p['paged_runs_overhead_cpu']:>+6.1%} | "
            f"{p['paged_scattered_overhead']:>+14.1%}"
        )
    ratios = [p for p in results["paged_vs_contiguous"] if "over_fp32" in p]
    if ratios:
        lines += [
            "",
            f"{setup['dtype']} against float32, the paged decode step (interleaved with the cases above):",
            f"{'batch':>5} | {'context':>7} | {setup['dtype']:>12} | {'float32':>10} | {'ratio':>6} | {'(median)':>8}",
            "-" * 65,
        ]
        for p in ratios:
            lines.append(
                f"{p['batch']:>5} | {p['context']:>7} | {p['paged_runs_ms']:>9.1f} ms | "
                f"{p['paged_fp32_ms']:>7.1f} ms | {p['over_fp32']:>6.2f} | {p['over_fp32_median']:>8.2f}"
            )
    s = results["startup"]
    lines += [
        "",
        f"start-up: Engine() {s['engine_init_s']:.2f} s in process; a fresh process (imports + load) "
        f"{s['fresh_import_and_init_s']:.2f} s ({s['fresh_process_s']:.2f} s with interpreter start)",
        f"total bench time {results['total_s']:.0f} s",
    ]
    return "\n".join(lines)
