"""The GPU check's correctness cases (gpu_check.py runs them by name): the tiny model through the engine against
transformers, teacher-forced, for each pipeline setting; and two tensor-parallel ranks against one."""

from __future__ import annotations

import time
import warnings

from overlap.bench.meter import log_progress


def run_waves(engine, waves: list[list]) -> dict[str, list[int]]:
    """Each wave of requests (RequestSpecs) added, then stepped to the end before the next; request id -> its
    tokens."""
    outputs: dict[str, list[int]] = {}
    for wave in waves:
        for spec in wave:
            engine.add_request(spec)
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


def case_correctness(check) -> None:
    """The tiny model through the engine vs transformers, teacher-forced, for each pipeline setting."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from overlap.engine.core import Engine
    from overlap.engine.model.builder import ensure_default_model
    from overlap.engine.types import RequestSpec, SamplingParams

    model_dir = ensure_default_model()
    rng = random.Random(0)
    firsts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(20, 150))] for _ in range(8)]
    # wave 2 shares the first waves' prompts' first 64 tokens (prefix-cache hits) and lands in freed, scattered blocks
    seconds = [p[:64] + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 60))] for p in firsts]
    settings = [("float32", b, g) for b in (1, 2) for g in (False, True)] + [("bfloat16", 2, True)]
    if check.dry:
        settings = [("float32", 1, False), ("float32", 2, False), ("bfloat16", 2, False)]
    sampling = SamplingParams(max_tokens=8 if check.dry else 32, temperature=0, ignore_eos=True)
    waves = [[RequestSpec(f"w{wave}-{i}", prompt, sampling) for i, prompt in enumerate(prompts)]
             for wave, prompts in enumerate((firsts, seconds))]  # fmt: skip
    references = {}
    for dtype, num_buffers, graphs in settings:
        started = time.perf_counter()
        config = check.engine_config(False, model=str(model_dir), dtype=dtype, num_buffers=num_buffers,
                                     cuda_graphs=graphs, max_num_batched_tokens=64, num_kv_blocks=256,
                                     max_seq_len=512)  # fmt: skip
        engine = Engine(config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if check.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = run_waves(engine, waves)
            finally:
                if check.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        syncs = sorted(
            {
                str(w.message).splitlines()[0]
                for w in caught
                if "synchroniz" in str(w.message).lower() and "prototype feature" not in str(w.message)
            }
        )
        stats = engine.stats()
        graph_steps = engine.runner.graph_steps
        engine.close()
        if dtype not in references:
            references[dtype] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            references[dtype] = references[dtype].to(check.device).eval()
        hf = references[dtype]
        agree = total = 0
        with torch.inference_mode():
            for wave, prompts in enumerate((firsts, seconds)):
                for i, prompt in enumerate(prompts):
                    out = outputs[f"w{wave}-{i}"]
                    ids = torch.tensor([prompt + out], device=check.device)
                    top = hf(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
                    agree += sum(a == b for a, b in zip(top, out, strict=True))
                    total += len(out)
        row = check.emit("correctness", dtype=dtype, num_buffers=num_buffers, cuda_graphs=graphs,
                         tokens=total, top1_agreement=agree / total, exact=agree == total,
                         prefix_cache_hits=stats.get("prefix_cache_hits_total"), graph_steps=graph_steps,
                         host_syncs_in_step_loop=syncs, seconds=time.perf_counter() - started)  # fmt: skip
        log_progress(f"correctness {dtype} buffers={num_buffers} graphs={graphs}: {row['top1_agreement']:.4f}")


def case_tensor_parallel(check) -> None:
    """The tiny model on 2 ranks (NCCL, GPUs 0 and 1; gloo in a dry run) against 1: the same greedy tokens, and the
    decode throughput of each. Skipped, and said so, on a machine with one GPU."""
    import torch

    from overlap.engine.core import Engine
    from overlap.engine.model.builder import ensure_default_model
    from overlap.engine.types import RequestSpec, SamplingParams

    gpus = 0 if check.dry else torch.cuda.device_count()
    if not check.dry and gpus < 2:
        check.emit("tensor_parallel", skipped=f"{gpus} GPU")
        log_progress(f"tensor_parallel: skipped, {gpus} GPU")
        return
    model_dir = ensure_default_model()
    prompts = [[3 + (7 * i + j) % 1900 for j in range(24 + i)] for i in range(8)]
    sampling = SamplingParams(max_tokens=8 if check.dry else 64, temperature=0, ignore_eos=True)
    tokens, rates = {}, {}
    for size in (1, 2):
        engine = Engine(check.engine_config(False, model=str(model_dir), dtype="float32", num_kv_blocks=256,
                                            max_seq_len=512, tensor_parallel_size=size))  # fmt: skip
        started, outputs = time.perf_counter(), {}
        for i, prompt in enumerate(prompts):
            engine.add_request(RequestSpec(f"r{i}", prompt, sampling))
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        rates[size] = sum(map(len, outputs.values())) / (time.perf_counter() - started)
        tokens[size] = [outputs[f"r{i}"] for i in range(len(prompts))]
        engine.close()
        engine.runner.close()
    check.emit("tensor_parallel", ranks=2, gpus=gpus, same_tokens=tokens[1] == tokens[2],
               tokens_per_s_1=rates[1], tokens_per_s_2=rates[2])  # fmt: skip


def format_rows(rows: list[dict]) -> list[str]:
    """The correctness cases' lines of the report."""
    lines = []
    for r in rows:
        if r["case"] == "correctness":
            lines.append(f"correctness {r['dtype']} buffers={r['num_buffers']} graphs={r['cuda_graphs']}: "
                         f"top-1 agreement {r['top1_agreement']:.4f} over {r['tokens']} tokens, host syncs "
                         f"{len(r['host_syncs_in_step_loop'])}")  # fmt: skip
        elif r["case"] == "tensor_parallel":
            lines.append(f"tensor parallel: skipped: {r['skipped']}" if "skipped" in r else
                         f"tensor parallel, 2 ranks: tokens {'equal to' if r['same_tokens'] else 'DIFFER from'} 1 "
                         f"rank's; {r['tokens_per_s_2']:.0f} tok/s vs {r['tokens_per_s_1']:.0f}")  # fmt: skip
    return lines
