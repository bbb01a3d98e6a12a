"""LoRA adapters made by PEFT, the producer, and transformers + PEFT's greedy tokens with them, the reference the
engine's are compared with (tests/engine/test_lora.py, tests/sidecar/test_serve_lora.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(base: Path, folder: Path, rank: int, alpha: float, rslora: bool, targets: list[str],
                 seed: int, spread: float = 0.05) -> Path:  # fmt: skip
    """PEFT's adapter on `base` with random A and B (B non-zero: PEFT's own init would leave it 0), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * spread)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers (+ PEFT with `adapter`) greedy continuations."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return _greedy(model, prompts, n)


def peft_greedy_each(base: Path, adapters: dict[str, Path | None], prompts: list[list[int]],
                     n: int) -> dict[str, list[list[int]]]:  # fmt: skip
    """peft_greedy for each of `adapters` (None: the base model), the base read once and each adapter put on it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    folders = {name: folder for name, folder in adapters.items() if folder is not None}
    outs = {}
    if folders:
        first, *rest = folders
        model = PeftModel.from_pretrained(model, folders[first], adapter_name=first)
        for name in rest:
            model.load_adapter(folders[name], adapter_name=name)
        for name in folders:
            model.set_adapter(name)
            outs[name] = _greedy(model, prompts, n)
    for name in [name for name, folder in adapters.items() if folder is None]:
        if folders:
            with model.disable_adapter():
                outs[name] = _greedy(model, prompts, n)
        else:
            outs[name] = _greedy(model, prompts, n)
    return outs


def _greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    model.eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def cached_adapter(base: Path, name: str, rank: int, alpha: float, rslora: bool, targets: list[str],
                   seed: int) -> Path:  # fmt: skip
    """make_adapter's folder, made once into Overlap's cache (`$OVERLAP_CACHE_DIR/test-adapters`) under a name
    that holds its settings; a half-written one (no weights yet) is made again."""
    from overlap.engine.model.builder import cache_root

    settings = f"{name}-r{rank}-a{alpha:g}{'-rs' if rslora else ''}-{'.'.join(targets)}-s{seed}"
    folder = cache_root() / "test-adapters" / base.name / settings
    if not (folder / "adapter_model.safetensors").exists():
        make_adapter(base, folder, rank, alpha, rslora, targets, seed)
    return folder
