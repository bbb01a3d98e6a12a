"""The GPU check's model-family cases (bench/gpu/check.sh runs them after the Llama ones; `check` is gpu_check's
`Check`):

- moe: a small Qwen3-MoE through the engine with the fused-MoE Triton kernels (model/triton_moe.py), then the decode
  step of Qwen3-30B-A3B's width (depth cut to 4 layers, random bf16 weights) at batch 1, 16 and 64, and again with
  every projection as llm-compressor's W4A16 writes it (the experts dequantized at load for the fused kernels).
- gemma: a small Gemma 3 (sliding and full layers, the sliding ones in their own KV pool, sized so that it must
  reuse the blocks behind the window), then the decode step of the Gemma 3 1B shape against its streaming floor.

Correctness is as in the Llama case: the engine's fp32 greedy tokens, chunked prompts and a second wave of prefix
hits (its prompts extend the first's), teacher-forced through transformers on the same device (its own random
init, `save_pretrained`; weights drawn wider than its default so the logits are not flat). A dry run
(`--dry-run-cpu`) runs the Triton kernels in the interpreter on small shapes, one decode row each.
"""

from __future__ import annotations

import json
import random
import time

from overlap.bench.gpu_correctness import run_waves
from overlap.bench.meter import log_progress

DRY_FAMILY_SHAPES = {
    "moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, vocab_size=512),
    "gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=32),
}  # fmt: skip


def _small_model(check, family: str):
    """A small random model of `family` saved by transformers, and transformers' fp32 model of it on the device."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3MoeConfig

    common = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, initializer_range=0.1)  # fmt: skip
    if check.dry:
        common.update(num_hidden_layers=2, vocab_size=512)
    if family == "qwen3-moe":  # top-2 of 8 experts renormalised
        config = Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                norm_topk_prob=True)  # fmt: skip
    else:  # sliding (window 32) then full layers, the sliding ones' own RoPE base, q/k norms
        config = Gemma3TextConfig(**common, query_pre_attn_scalar=32, sliding_window=32, sliding_window_pattern=2)
    folder = check.tmp / f"{family}-small"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(check.device).eval()
    return folder, hf


def _family_correctness(check, family: str) -> dict:
    """The small model's fp32 greedy tokens through the engine on the device paths, teacher-forced against
    transformers: two waves of 8 prompts (2 in a dry run), the second extending the first's (prefix-cache hits)."""
    import torch

    from overlap.engine.core import Engine
    from overlap.engine.model.runner import ModelRunner
    from overlap.engine.types import RequestSpec, SamplingParams

    folder, hf = _small_model(check, family)
    vocab = hf.config.vocab_size
    rng = random.Random(1)
    num, longest = (2, 70) if check.dry else (8, 140)
    firsts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(40, longest))] for _ in range(num)]
    # the second wave extends the first's prompts (a conversation's next turn): its hits need the sliding layers'
    # blocks at the end of those prompts, the last ones freed
    seconds = [p + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for p in firsts]
    # 4 sequences at once and chunks of 32: the sliding layers' pool (18 blocks) is smaller than their context
    config = check.engine_config(model=str(folder), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
                                 num_kv_blocks=64, max_seq_len=512, cuda_graphs=False)  # fmt: skip
    runner = ModelRunner(config, folder, cpu_paths=False)
    engine = Engine(config, runner=runner)
    sampling = SamplingParams(max_tokens=3 if check.dry else 32, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = run_waves(engine, [[RequestSpec(f"w{wave}-{i}", prompt, sampling) for i, prompt in enumerate(prompts)]
                                 for wave, prompts in enumerate((firsts, seconds))])  # fmt: skip
    stats = engine.stats()
    engine.close()
    runner.close()
    agree = total = 0
    with torch.inference_mode():
        for wave, prompts in enumerate((firsts, seconds)):
            for i, prompt in enumerate(prompts):
                out = outputs[f"w{wave}-{i}"]
                top = hf(torch.tensor([prompt + out], device=check.device)).logits[0, len(prompt) - 1 : -1].argmax(-1)
                agree += sum(a == b for a, b in zip(top.tolist(), out, strict=True))
                total += len(out)
    return dict(tokens=total, top1_agreement=agree / total, exact=agree == total,
                prefix_cache_hits=stats["prefix_cache_hits_total"], window_kv_blocks=stats["num_window_kv_blocks"],
                kv_blocks=stats["num_kv_blocks"], seconds=time.perf_counter() - started)  # fmt: skip


def _decode_rows(check, family: str, shape: str, layers: int, floor: bool, quantization: str | None = None) -> None:
    """The decode step of `shape` (depth cut to `layers`; small shapes in a dry run), random bf16 weights (or codes
    in `quantization`'s layout)."""
    from overlap.bench.floor import decode_floor_bytes
    from overlap.bench.overlap_load import measure_overlap
    from overlap.engine.model.runner import ModelRunner
    from overlap.engine.model.shapes import shape_config

    config_json = shape_config(shape, quantization)
    config_json.update(DRY_FAMILY_SHAPES[family] if check.dry else {"num_hidden_layers": layers})
    folder = check.tmp / "-".join(filter(None, (shape, quantization, str(layers))))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json))
    # a dry run checks the script, not the speed: one batch, a step of warm-up and two measured
    warmup, batches, steps = (1, (1,), 2) if check.dry else (3, (1, 16, 64), check.steps)
    max_tokens = 2 * (warmup + steps) + 2
    blocks = max(batches) * -(-(check.prompt_len + max_tokens) // 16) + 64
    config = check.engine_config(dtype="bfloat16", num_kv_blocks=blocks, max_num_seqs=max(batches), max_seq_len=512)
    runner = ModelRunner(config, folder, random_weights=True, cpu_paths=not check.dry)
    for batch in batches:
        result = measure_overlap(runner, 2, batch=batch, steps=steps, host_ms=0.0, warmup_steps=warmup,
                                 prompt_len=check.prompt_len, max_tokens=max_tokens)  # fmt: skip
        step_s = batch / result.tokens_per_s if result.tokens_per_s else float("inf")
        context = check.prompt_len + warmup + steps / 2
        floor_s = None
        if floor and check.bandwidth:
            floor_s = decode_floor_bytes(runner, batch, context) / check.bandwidth
        model = f"{shape}{f' {quantization}' if quantization else ''} x{runner.spec.num_layers} layers"
        check.emit(family, model=model, batch=batch, step_ms=1000 * step_s,
                   floor_ms=None if floor_s is None else 1000 * floor_s,
                   step_over_floor=None if floor_s is None else step_s / floor_s,
                   weight_bytes=runner.weight_bytes, kernels=runner.kernels)  # fmt: skip
        log_progress(f"{family} {model} batch {batch}: {1000 * step_s:.2f} ms a step ({runner.kernels})")
    runner.close()


def _with_fused_moe_on_cpu(check, fn):
    """The fused-MoE kernels run on a CUDA device; in a dry run the layer is told to take them in the interpreter."""
    from overlap.engine.model.layers import moe

    before = moe.FUSED_ON_CPU
    moe.FUSED_ON_CPU = check.dry
    try:
        return fn()
    finally:
        moe.FUSED_ON_CPU = before


def case_moe(check) -> None:
    row = _with_fused_moe_on_cpu(check, lambda: _family_correctness(check, "qwen3-moe"))
    check.emit("moe_correctness", family="qwen3-moe", **row)
    log_progress(f"moe correctness: top-1 agreement {row['top1_agreement']:.4f} over {row['tokens']} tokens")
    # the floor of a sparse step is the bytes of the experts it touches: `overlap bench moe` measures that on a CPU
    _with_fused_moe_on_cpu(check, lambda: _decode_rows(check, "moe", "qwen3-30b-a3b", 4, floor=False))
    # its experts as llm-compressor's W4A16 writes them, dequantized for the fused kernels (a dry run's widths take
    # no group of 128: W8A8 there)
    scheme = "w8a8" if check.dry else "w4a16"
    _with_fused_moe_on_cpu(check, lambda: _decode_rows(check, "moe", "qwen3-30b-a3b", 4, floor=False,
                                                       quantization=scheme))  # fmt: skip


def case_gemma(check) -> None:
    row = _family_correctness(check, "gemma-3")
    check.emit("gemma_correctness", family="gemma-3", **row)
    log_progress(f"gemma correctness: top-1 agreement {row['top1_agreement']:.4f} over {row['tokens']} tokens")
    _decode_rows(check, "gemma", "gemma-3-1b", 26, floor=True)


def format_rows(rows: list[dict]) -> list[str]:
    """The family cases' lines of the report table."""
    lines = []
    for r in rows:
        if r["case"] in ("moe_correctness", "gemma_correctness"):
            lines.append(f"{r['family']} fp32 through the engine: top-1 agreement {r['top1_agreement']:.4f} over "
                         f"{r['tokens']} tokens, {r['prefix_cache_hits']} prefix-hit tokens, KV pool "
                         f"{r['kv_blocks']} + {r['window_kv_blocks']} sliding blocks")  # fmt: skip
        elif r["case"] in ("moe", "gemma"):
            floor = "" if r["floor_ms"] is None else f", {r['floor_ms']:.2f} ms floor ({r['step_over_floor']:.2f}x)"
            lines.append(f"{r['case']} {r['model']} batch {r['batch']}: {r['step_ms']:.2f} ms a step{floor}")
    return lines
