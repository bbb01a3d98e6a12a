"""The GPU check's quantized case (gpu_check.py runs it by name): each quantized scheme at the largest shape, its
decode steps against the streaming floor of the stored bytes and its last logits against the same codes dequantized
at load."""

from __future__ import annotations

import os

from overlap.bench.floor import decode_floor_bytes
from overlap.bench.meter import log_progress

QUANTIZED_SCHEMES = ("w4a16", "w8a8", "fp8", "fp8-block")


def case_quantized(check) -> None:
    """Each quantized scheme (random codes in its producer's layout) at the largest shape: W4A16 and block-FP8
    through the Triton kernel that dequantizes inside the matmul, W8A8 through `torch._int_mm` (cuBLASLt int8), FP8
    with a scale per row through `torch._scaled_mm` (per-token FP8 activations) where the card has FP8. Decode steps
    against the streaming floor of the stored bytes, and the last logits of 4 prompts against the same codes
    dequantized at load (OVERLAP_QUANTIZED_KERNELS=0) through the bf16 path."""
    # a dry run on the CPU checks the script: there fp8 and w8a8 take the paths fp8-block and the bf16 reference take
    for scheme in ("w4a16", "fp8-block") if check.dry else QUANTIZED_SCHEMES:
        _quantized_scheme(check, scheme)


def _quantized_scheme(check, scheme: str) -> None:
    from overlap.bench.overlap_load import measure_overlap
    from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

    name = list(check.shapes)[-1]  # the largest shape
    warmup, batches = 3, ((1,) if check.dry else (1, 16, 64))  # a dry run checks the script, not the speed
    max_tokens = 2 * (warmup + check.steps) + 2
    runner, load_s = check.random_runner(name, check.prompt_len + max_tokens, max(batches), quantization=scheme)
    log_progress(f"quantized {name} {scheme}: runner ready in {load_s:.1f} s ({runner.kernels})")
    for batch in batches:
        result = measure_overlap(runner, 2, batch=batch, steps=check.steps, host_ms=0.0, warmup_steps=warmup,
                                 prompt_len=check.prompt_len, max_tokens=max_tokens)  # fmt: skip
        step_s = batch / result.tokens_per_s if result.tokens_per_s else float("inf")
        context = check.prompt_len + warmup + check.steps / 2
        floor_s = decode_floor_bytes(runner, batch, context) / check.bandwidth if check.bandwidth else None
        check.emit("quantized", model=name, quantization=scheme, batch=batch, step_ms=1000 * step_s,
                   floor_ms=None if floor_s is None else 1000 * floor_s,
                   step_over_floor=None if floor_s is None else step_s / floor_s, weight_bytes=runner.weight_bytes,
                   kernels=runner.kernels)  # fmt: skip
        log_progress(f"quantized {name} {scheme} batch {batch}: {1000 * step_s:.2f} ms a step")
    runner.close()

    def last_logits(kernels: str):
        previous = os.environ.get("OVERLAP_QUANTIZED_KERNELS")
        os.environ["OVERLAP_QUANTIZED_KERNELS"] = kernels
        try:
            r, _ = check.random_runner(name, 256, 4, graphs=False, quantization=scheme)
        finally:
            os.environ.pop("OVERLAP_QUANTIZED_KERNELS") if previous is None else os.environ.update(
                OVERLAP_QUANTIZED_KERNELS=previous)  # fmt: skip
        prompts = [[5 + (7 * i + j) % 500 for j in range(24 + 8 * i)] for i in range(4)]
        seqs = [ScheduledSeq(f"q{i}", p, 0, list(range(16 * i, 16 * i + 16)), True, SamplingParams(temperature=0))
                for i, p in enumerate(prompts)]  # fmt: skip
        logits = r.compute_logits(ModelInput(seqs)).float().cpu()
        r.close()
        return logits

    # Random weights give near-flat logits, where greedy tokens say little: the logits themselves are compared.
    kernel, reference = last_logits("1"), last_logits("0")
    diff = float((kernel - reference).abs().max())
    check.emit("quantized_logits", model=name, quantization=scheme, max_abs_diff=diff,
               reference_std=float(reference.std()), top1_equal=int((kernel.argmax(-1) == reference.argmax(-1)).sum()),
               prompts=kernel.shape[0])  # fmt: skip
    log_progress(f"quantized {name} {scheme}: logits within {diff:.4f} of the dequantized reference's "
              f"(std {reference.std():.4f})")  # fmt: skip


def format_rows(rows: list[dict]) -> list[str]:
    """The quantized case's lines of the report."""
    lines = []
    for r in rows:
        if r["case"] == "quantized":
            floor = "-" if r["floor_ms"] is None else f"{r['floor_ms']:.2f} ms floor ({r['step_over_floor']:.2f}x)"
            lines.append(f"quantized {r['model']} {r['quantization']} batch {r['batch']}: {r['step_ms']:.2f} ms a "
                         f"step, {floor}, {r['weight_bytes'] / 1e9:.2f} GB of weights")  # fmt: skip
        elif r["case"] == "quantized_logits":
            lines.append(f"quantized {r['model']} {r['quantization']}: last logits within {r['max_abs_diff']:.4f} of "
                         f"the dequantized reference's (std {r['reference_std']:.4f}), top token equal in "
                         f"{r['top1_equal']} of {r['prompts']} prompts")  # fmt: skip
    return lines
