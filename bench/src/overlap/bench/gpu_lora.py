"""The GPU check's LoRA case (gpu_check.py runs it by name): the tiny model with two random adapters of rank 8 on
every projection, the base and both adapters mixed in one batch, through the engine on the GPU (the Triton BGMV
shrink and expand kernels) against the same batch on the CPU (the gathered matmuls, which `make test` holds equal
to transformers + PEFT): fp32 greedy tokens must be equal, row by row. The machine's PEFT is not needed: the
adapters are written in PEFT's layout by `overlap bench lora`'s writer."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from overlap.bench.gpu_correctness import run_waves
from overlap.bench.meter import log_progress

_ADAPTERS = 2


def _mixed_tokens(config, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> list[list[int]]:
    from overlap.engine.core import Engine
    from overlap.engine.types import RequestSpec, SamplingParams

    engine = Engine(config)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        rows = zip(prompts, names, strict=True)
        outputs = run_waves(
            engine, [[RequestSpec(f"r{i}", p, sampling, lora_name=name) for i, (p, name) in enumerate(rows)]]
        )
    finally:
        engine.close()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def case_lora(check) -> None:
    from overlap.bench.lora_bench import write_adapters
    from overlap.engine.config import EngineConfig
    from overlap.engine.model.builder import ensure_default_model
    from overlap.engine.model.model_spec import read_spec

    model_dir = ensure_default_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(12, 80))] for _ in range(6)]
    names = [None if i % 3 == 0 else f"adapter-{i % 3 - 1}" for i in range(len(prompts))]
    max_tokens = 8 if check.dry else 32
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="overlap-gpu-lora-") as tmp:
        adapters = write_adapters(read_spec(Path(model_dir)), Path(tmp), _ADAPTERS, rank=8)
        lora = {"enable_lora": True, "max_loras": _ADAPTERS, "max_lora_rank": 8, "lora_modules": adapters}
        common = {"model": str(model_dir), "dtype": "float32", "num_kv_blocks": 128, "max_seq_len": 256, **lora}
        device = _mixed_tokens(check.engine_config(False, **common), prompts, names, max_tokens)
        host = _mixed_tokens(EngineConfig(device="cpu", **common), prompts, names, max_tokens)
    equal = sum(d == h for d, h in zip(device, host, strict=True))
    row = check.emit("lora", adapters=_ADAPTERS, rows=len(prompts), tokens=max_tokens * len(prompts),
                     rows_equal=equal, seconds=time.perf_counter() - started)  # fmt: skip
    log_progress(f"lora: {row['rows_equal']} of {row['rows']} mixed rows equal to the CPU path's")


def format_rows(rows: list[dict]) -> list[str]:
    """The LoRA case's line of the report."""
    return [f"lora fp32, base and {r['adapters']} adapters in one batch: {r['rows_equal']} of {r['rows']} rows' greedy "
            "tokens equal to the CPU path's (which make test holds equal to transformers + PEFT)"
            for r in rows if r["case"] == "lora"]  # fmt: skip
