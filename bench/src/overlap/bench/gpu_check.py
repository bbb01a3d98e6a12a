"""The GPU check (bench/gpu/check.sh): what the CUDA path does on a real NVIDIA GPU, in one run of under 8 minutes.

It runs with the torch, Triton and transformers the GPU machine already has (nothing installed; check.sh puts the
components' sources on PYTHONPATH) and appends one JSON line per case to --out as it goes, so a run cut short still
leaves its data. Cases, most valuable first:

1. env: the GPU, torch, Triton, transformers.
2. bandwidth: device-to-device copy bandwidth (read + write bytes per second), the roofline's denominator.
3. correctness: the tiny model through the engine (chunked prefill, prefix-cache hits, fragmented block tables after
   a first wave frees its blocks) against transformers on the same GPU, teacher-forced: fp32 must pick
   transformers' top token at every position (greedy exact), bf16 reports its agreement; with 1 and 2 buffers and
   CUDA graphs on and off; plus the host syncs `torch.cuda.set_sync_debug_mode` saw in the step loop. And
   tensor_parallel: two ranks' tokens against one's (gpu_correctness.py).
4. decode: random-weight Llama shapes of ~1B and ~8B in bf16 (weights made on the device), tok/s and step time at
   batch 1, 16, 64, 128, 256 against the step's streaming floor: (weights + the K/V it reads) / the copy bandwidth.
   Batch 1 also without CUDA graphs.
5. prefill: prompt tok/s for the same shapes.
6. busy: device busy share at batch 64 with 1 and 2 buffers, by CUDA events (what the engine reports) and by kernel
   time (torch's profiler over the same steps), which exposes a launch-bound step.
7. profile: where a decode step's device time goes, ~8B shape at batch 1 and 64 with graphs: kernel time per step
   by kernel name (torch's profiler), the kernels per step, the heaviest ones.
8. quantized: each quantized scheme at the ~8B shape (gpu_quantized.py).
9. moe, gemma: a small Qwen3-MoE through the fused-MoE kernels and a small Gemma 3 (its sliding layers' own KV
   pool) against transformers, and their real widths' decode steps, the MoE's also with W4A16 experts
   (gpu_check_families.py).
10. speculative: ngram at the ~8B shape, batch 1: a step verifying 4 proposals against the plain step and the floor,
    the tokens it appends, and what prompt lookup reaches through the engine (gpu_spec.py).
11. lora: the base and two adapters mixed in one fp32 batch through the Triton BGMV kernels, against the CPU path
    (gpu_lora.py).

`--dry-run-cpu` runs every case on the CPU with small shapes (Triton's interpreter for the attention kernel), so
the script itself is tested where there is no GPU. Without CUDA (and without --dry-run-cpu) it exits 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from overlap.bench import gpu_check_families, gpu_correctness, gpu_lora, gpu_quantized, gpu_spec
from overlap.bench.floor import decode_floor_bytes
from overlap.bench.gpu_check_families import case_gemma, case_moe  # noqa: F401 (cases run by name)
from overlap.bench.gpu_correctness import case_correctness, case_tensor_parallel  # noqa: F401 (run by name)
from overlap.bench.gpu_lora import case_lora  # noqa: F401 (run by name)
from overlap.bench.gpu_quantized import case_quantized  # noqa: F401 (run by name)
from overlap.bench.gpu_spec import case_speculative  # noqa: F401 (run by name)
from overlap.bench.meter import log_progress

# Shapes of the models people serve, with random weights (vocabulary and context as theirs).
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),  # Llama 3.2 1B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),  # Llama 3.1 8B
}  # fmt: skip
DRY_RUN_SHAPES = {
    "llama-dry-a": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
    "llama-dry-b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024),
}  # fmt: skip
CASES = ("env", "bandwidth", "correctness", "decode", "prefill", "busy", "tensor_parallel", "profile", "quantized",
         "moe", "gemma", "speculative", "lora")  # fmt: skip


def require_cuda() -> str:
    """The GPU's name, or a clear error (exit 2) when this machine has none."""
    try:
        import torch
    except ImportError as exc:
        raise SystemExit(f"overlap gpu check: torch is not installed ({exc})") from None
    if not torch.cuda.is_available():
        print(
            f"overlap gpu check: no CUDA device: torch {torch.__version__} sees no NVIDIA GPU "
            "(torch.cuda.is_available() is False). Run bench/gpu/check.sh on a machine with an NVIDIA GPU and a "
            "CUDA build of torch, or add --dry-run-cpu to check the script on this CPU.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return torch.cuda.get_device_name(0)


class Check:
    """What every case shares: the device, the sizes for this run, and the output file."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.dry = args.dry_run_cpu
        self.device = torch.device("cpu" if self.dry else "cuda")
        self.shapes = DRY_RUN_SHAPES if self.dry else SHAPES
        self.batches = (1, 4, 8) if self.dry else (1, 16, 64, 128, 256)
        self.busy_batch = 8 if self.dry else 64
        self.steps = 3 if self.dry else args.steps
        self.prompt_len = 16 if self.dry else 128
        self.bandwidth = None  # bytes per second, from the bandwidth case
        self.out = Path(args.out)
        self.rows: list[dict] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="overlap-gpu-check-"))

    def emit(self, case: str, **row) -> dict:
        row = {"case": case, **row}
        self.rows.append(row)
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def model_dir(self, name: str, quantization: str | None = None) -> Path:
        """A folder with only config.json: the runner makes the weights on the device (random_weights); with
        `quantization` (a name of shapes.QUANT_SCHEMES), its projections are random codes in that scheme's layout."""
        from transformers import LlamaConfig

        folder = self.tmp / "-".join(filter(None, (name, quantization)))
        if not folder.exists():
            shape = self.shapes[name]
            LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16").save_pretrained(folder)
            if quantization is not None:
                from overlap.engine.model.shapes import shape_config

                config = json.loads((folder / "config.json").read_text())
                config["quantization_config"] = shape_config("qwen2.5-0.5b", quantization)["quantization_config"]
                (folder / "config.json").write_text(json.dumps(config))
        return folder

    def engine_config(self, interpret: bool = True, **changes):
        """A config for this device. In a dry run the attention is Triton's interpreter where `interpret` (runners
        on the device paths), else torch ops (an Engine's runner takes the CPU paths)."""
        from overlap.engine.config import EngineConfig

        attention = "auto"
        if self.dry:
            attention = "triton" if interpret and os.environ.get("TRITON_INTERPRET") == "1" else "torch"
        return EngineConfig(device=self.device.type, attention_backend=attention, **changes)

    def random_runner(self, name: str, tokens_per_seq: int, batch: int, graphs: bool = True,
                      quantization: str | None = None):  # fmt: skip
        """A bf16 runner of shape `name` with random weights and a pool for `batch` sequences of `tokens_per_seq`
        tokens; and the seconds it took to make."""
        from overlap.engine.model.runner import ModelRunner

        blocks = batch * -(-tokens_per_seq // 16) + 64
        config = self.engine_config(dtype="bfloat16", num_kv_blocks=blocks, max_num_seqs=batch, max_seq_len=2048,
                                    cuda_graphs=graphs)  # fmt: skip
        started = time.perf_counter()
        runner = ModelRunner(config, self.model_dir(name, quantization), random_weights=True, cpu_paths=not self.dry)
        return runner, time.perf_counter() - started


# ---- the cases ----------------------------------------------------------------------------------------------------


def case_env(check: Check) -> None:
    import platform

    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(0) if check.device.type == "cuda" else "CPU (dry run)"
    capability = list(torch.cuda.get_device_capability(0)) if check.device.type == "cuda" else None
    check.emit("env", gpu=gpu, capability=capability, torch=torch.__version__, cuda=torch.version.cuda,
               triton=triton_version, transformers=transformers.__version__,
               python=platform.python_version())  # fmt: skip


def case_bandwidth(check: Check) -> None:
    """Device-to-device copies of a large buffer: bytes read + written per second (best of the rounds)."""
    import torch

    size = (64 << 20) if check.dry else (4 << 30)
    src = torch.empty(size, dtype=torch.uint8, device=check.device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3 if check.dry else 10):
        check.sync()
        start = time.perf_counter()
        dst.copy_(src)
        check.sync()
        best = min(best, time.perf_counter() - start)
    check.bandwidth = 2 * size / best
    check.emit("bandwidth", bytes=size, seconds=best, bytes_per_s=check.bandwidth)


def case_decode(check: Check) -> None:
    from overlap.bench.overlap_load import measure_overlap

    warmup = 5
    max_tokens = 2 * (warmup + check.steps) + 2  # no request finishes while measured: every step a pure decode
    for name in check.shapes:
        runner, load_s = check.random_runner(name, check.prompt_len + max_tokens, max(check.batches))
        log_progress(f"decode {name}: runner ready in {load_s:.1f} s ({runner.kernels})")
        runs = [(b, True) for b in check.batches] + [(1, False)]
        for batch, graphs in runs:
            if not graphs:
                runner.close()
                runner, _ = check.random_runner(name, check.prompt_len + max_tokens, max(check.batches), graphs=False)
            graph_steps = runner.graph_steps
            result = measure_overlap(runner, 2, batch=batch, steps=check.steps, host_ms=0.0, warmup_steps=warmup,
                                     prompt_len=check.prompt_len, max_tokens=max_tokens)  # fmt: skip
            step_s = batch / result.tokens_per_s if result.tokens_per_s else float("inf")
            context = check.prompt_len + warmup + check.steps / 2
            floor_s = decode_floor_bytes(runner, batch, context) / check.bandwidth if check.bandwidth else None
            check.emit("decode", model=name, dtype="bfloat16", batch=batch, cuda_graphs=graphs,
                       graph_steps=runner.graph_steps - graph_steps,
                       tokens_per_s=result.tokens_per_s, step_ms=1000 * step_s,
                       device_ms_per_step=result.device_ms_per_step, host_ms_per_step=result.host_ms_per_step,
                       floor_ms=None if floor_s is None else 1000 * floor_s,
                       step_over_floor=None if floor_s is None else step_s / floor_s,
                       mean_context=context, kernels=runner.kernels, runner_start_s=load_s)  # fmt: skip
            log_progress(f"decode {name} batch {batch} graphs={graphs}: {result.tokens_per_s:.0f} tok/s")
        runner.close()


def case_prefill(check: Check) -> None:
    from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

    num, length = (2, 64) if check.dry else (4, 2048)
    for name in check.shapes:
        runner, _ = check.random_runner(name, length, num)
        blocks = -(-length // 16)
        seqs = [ScheduledSeq(f"p{i}", [5 + (i + j) % 300 for j in range(length)], 0,
                             list(range(i * blocks, (i + 1) * blocks)), True, SamplingParams(temperature=0))
                for i in range(num)]  # fmt: skip
        best = float("inf")
        for _ in range(2 if check.dry else 4):  # the first compiles and warms up
            check.sync()
            start = time.perf_counter()
            runner.execute(ModelInput(seqs))
            check.sync()
            best = min(best, time.perf_counter() - start)
        check.emit("prefill", model=name, dtype="bfloat16", prompts=num, prompt_len=length, seconds=best,
                   tokens_per_s=num * length / best)  # fmt: skip
        log_progress(f"prefill {name}: {num * length / best:.0f} tok/s")
        runner.close()


def case_busy(check: Check) -> None:
    """Busy share at one batch, 1 vs 2 buffers: CUDA events (the engine's figure) and kernel time (the profiler)."""
    import torch

    from overlap.bench.overlap_load import DecodeLoad
    from overlap.engine.execution import make_executor
    from overlap.engine.execution.busy import BusyTracker
    from overlap.engine.execution.cuda import kernel_time_s

    batch, warmup = check.busy_batch, 5
    max_tokens = 2 * (warmup + check.steps) + 2
    name = list(check.shapes)[-1]
    runner, _ = check.random_runner(name, check.prompt_len + max_tokens, batch)
    for num_buffers in (1, 2):
        executor = make_executor(runner, num_buffers)
        load = DecodeLoad(executor, batch=batch, num_requests=batch, prompt_len=check.prompt_len,
                          max_tokens=max_tokens)  # fmt: skip
        load.run(max_steps=warmup)
        executor.busy = BusyTracker(window_s=float("inf"))
        activities = [torch.profiler.ProfilerActivity.CUDA if check.device.type == "cuda"
                      else torch.profiler.ProfilerActivity.CPU]  # fmt: skip
        check.sync()
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            load.run(max_steps=warmup + check.steps)
            check.sync()
            wall = time.perf_counter() - start
        executor.close()
        snap = executor.busy.snapshot()
        kernel_share = None
        if check.device.type == "cuda":
            kernel_share = kernel_time_s(prof) / wall
        check.emit("busy", model=name, batch=batch, num_buffers=num_buffers, steps=check.steps,
                   event_busy_share=snap.busy_ratio, kernel_busy_share=kernel_share, wall_s=wall)  # fmt: skip
        log_progress(f"busy {name} buffers={num_buffers}: events {snap.busy_ratio:.3f}, kernels {kernel_share}")
    runner.close()


def case_profile(check: Check) -> None:
    """Kernel time per decode step by kernel name (2 buffers, graphs on): what to fuse or speed up next."""
    import torch

    from overlap.bench.overlap_load import DecodeLoad
    from overlap.engine.execution import make_executor

    warmup = 5
    max_tokens = 2 * (warmup + check.steps) + 2
    name = list(check.shapes)[-1]
    activity = (
        torch.profiler.ProfilerActivity.CUDA if check.device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    )
    for batch in (1, check.busy_batch):
        runner, _ = check.random_runner(name, check.prompt_len + max_tokens, check.busy_batch)  # a pool for max_seq_len
        executor = make_executor(runner, 2)
        load = DecodeLoad(executor, batch=batch, num_requests=batch, prompt_len=check.prompt_len,
                          max_tokens=max_tokens)  # fmt: skip
        load.run(max_steps=warmup)
        check.sync()
        with torch.profiler.profile(activities=[activity]) as prof:
            load.run(max_steps=warmup + check.steps)
            check.sync()
        executor.close()
        runner.close()
        device = torch.autograd.DeviceType.CUDA if check.device.type == "cuda" else torch.autograd.DeviceType.CPU
        by_name: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == device and (check.dry or not e.name.startswith(("Memcpy", "Memset"))):
                entry = by_name.setdefault(e.name[:90], [0.0, 0])
                entry[0] += (e.time_range.end - e.time_range.start) / 1000 / check.steps  # ms per step
                entry[1] += 1 / check.steps
        top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
        check.emit("profile", model=name, batch=batch, steps=check.steps,
                   kernel_ms_per_step=sum(v[0] for v in by_name.values()),
                   kernels_per_step=sum(v[1] for v in by_name.values()),
                   top=[[n, round(ms, 4), round(c, 1)] for n, (ms, c) in top])  # fmt: skip
        log_progress(f"profile {name} batch {batch}: {sum(v[0] for v in by_name.values()):.2f} kernel ms per step")


# ---- report ---------------------------------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    """The decode rows as the README's table, then the other cases one line each."""
    env = next((r for r in rows if r["case"] == "env"), None)
    lines = [] if env is None else [f"Overlap GPU check on {env['gpu']}: torch {env['torch']}, Triton {env['triton']}"]
    decode = [r for r in rows if r["case"] == "decode"]
    if decode:
        lines += [
            "",
            "| model | batch | CUDA graphs | tok/s | step ms | floor ms | step / floor |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in decode:
            floor = "-" if r["floor_ms"] is None else f"{r['floor_ms']:.2f}"
            ratio = "-" if r["step_over_floor"] is None else f"{r['step_over_floor']:.2f}"
            lines.append(f"| {r['model']} | {r['batch']} | {'on' if r['graph_steps'] else 'off'} | "
                         f"{r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | {floor} | {ratio} |")  # fmt: skip
    for r in rows:
        if r["case"] == "prefill":
            lines.append(f"prefill {r['model']}: {r['tokens_per_s']:.0f} tok/s ({r['prompts']} x {r['prompt_len']})")
        elif r["case"] == "profile":
            lines.append(f"profile {r['model']} batch {r['batch']}: {r['kernel_ms_per_step']:.2f} kernel ms, "
                         f"{r['kernels_per_step']:.0f} kernels per step; heaviest (ms, count per step):")  # fmt: skip
            lines += [f"    {ms:8.4f} {count:6.1f}  {kernel}" for kernel, ms, count in r["top"]]
        elif r["case"] == "busy":
            kernels = "-" if r["kernel_busy_share"] is None else f"{r['kernel_busy_share']:.3f}"
            lines.append(f"busy {r['model']} batch {r['batch']} buffers={r['num_buffers']}: "
                         f"events {r['event_busy_share']:.3f}, kernels {kernels}")  # fmt: skip
        elif r["case"] == "bandwidth":
            lines.append(f"device-to-device copy: {r['bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
        elif r["case"] == "error":
            lines.append(f"{r['failed']} FAILED: {r['error']}")
    for module in (gpu_correctness, gpu_quantized, gpu_check_families, gpu_spec, gpu_lora):
        lines += module.format_rows(rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu/check.sh", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="gpu-check.jsonl", help="append one JSON line per case (default ./gpu-check.jsonl)"
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, in this order: {','.join(CASES)}")
    parser.add_argument("--steps", type=int, default=40, help="measured decode steps per row (default 40)")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="every case on this CPU, small shapes (Triton's interpreter where installed)")  # fmt: skip
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.dry_run_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    else:
        require_cuda()
    check = Check(args)
    started = time.perf_counter()
    try:
        run_cases(check, cases)
    finally:
        shutil.rmtree(check.tmp, ignore_errors=True)
    print(format_table(check.rows))
    print(f"({time.perf_counter() - started:.0f} s; rows appended to {check.out})")
    return 1 if any(r["case"] == "error" for r in check.rows) else 0


def run_cases(check: Check, cases: list[str]) -> None:
    for case in CASES:
        if case not in cases:
            continue
        log_progress(f"case {case}")
        try:
            globals()[f"case_{case}"](check)
        except Exception as exc:  # the next case still runs; the line says what broke
            import traceback

            traceback.print_exc()
            check.emit("error", failed=case, error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
