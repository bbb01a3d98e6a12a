"""Writes one real compressed-tensors checkpoint with llm-compressor: a small random-weight model from transformers'
own config classes, quantized data-free by `oneshot` + `QuantizationModifier`, saved with `save_compressed=True`.

Runs only inside llm-compressor's own venv (tests/support/quantized_models.py creates it and starts this script):
llm-compressor pins transformers and compressed-tensors to exact releases the main venv must not be held to.

    python quant_producer.py --family llama --scheme W4A16 --out DIR"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

SIZE = dict(
    vocab_size=512,
    hidden_size=256,  # 256 and 512: multiples of 128 and 32, the group sizes below
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    initializer_range=0.02,  # transformers' default: Linear and Embedding weights ~ normal(0, 0.02)
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**SIZE),
    "qwen2": lambda: Qwen2Config(**SIZE),  # q/k/v biases (Qwen2's attention always has them)
    "qwen3": lambda: Qwen3Config(**SIZE),  # q_norm/k_norm over head_dim
    # mixtures of experts: llm-compressor writes each expert's projections as a Linear of its own
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SIZE, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    ),
    "mixtral": lambda: MixtralConfig(**SIZE, num_local_experts=4, num_experts_per_tok=2),
}
# the routers, which llm-compressor's MoE examples leave in float (`re:.*mlp.gate$`)
ROUTERS = {"qwen3_moe": "re:.*mlp.gate$", "mixtral": "re:.*block_sparse_moe.gate$"}


def _w4a16(group_size: int, symmetric: bool = True) -> dict:
    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=symmetric)
    return {"config_groups": {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}}


# Data-free: static weights, dynamic (per-token) activations or none; except "FP8", whose static per-tensor input
# scales llm-compressor calibrates (it refuses to run it without a dataset): random token ids stand in (CALIBRATED).
SCHEMES = {
    "FP8_DYNAMIC": {"scheme": "FP8_DYNAMIC"},  # fp8 e4m3 weights, per-channel scales; fp8 per-token activations
    "FP8": {"scheme": "FP8"},  # fp8 weights and activations, per-tensor static scales
    "W8A8": {"scheme": "W8A8"},  # int8 per-channel symmetric weights; int8 per-token dynamic symmetric activations
    "W8A16": {"scheme": "W8A16"},  # int8 weights, group 128 symmetric (compressed-tensors 0.19's preset)
    "W4A16": {"scheme": "W4A16"},  # int4 weights, group 128 symmetric
    "W4A16_G32": _w4a16(32),
    "W4A16_ASYM": {"scheme": "W4A16_ASYM"},  # int4 weights, group 128, with zero points
}
CALIBRATED = {"FP8"}


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def random_model(family: str, folder: Path) -> torch.nn.Module:
    """Seeded random weights in bfloat16 (the dtype real checkpoints ship, so the scales come out bfloat16 too),
    logits spread; biases and norm weights perturbed, as transformers initialises them to 0 and 1 and would leave
    them untested. Saved to `folder` and loaded back, as oneshot expects: it reads the config again from
    `name_or_path`."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        # Spread the logits, as the tiny default model does (overlap.engine.model.builder._sharpen): with the 0.02
        # init they are nearly flat, and greedy tokens would hang on near-ties that rounding flips.
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(10.0)
        for name, param in model.named_parameters():  # routers too: near-tied experts would flip the same way
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(50.0)
    model.to(torch.bfloat16).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def calibration(vocab_size: int, samples: int = 8, length: int = 32) -> dict:
    """oneshot's dataset and processor for a static scheme: random token ids (no download) and a stand-in
    word-level tokenizer, which oneshot insists on whenever a dataset is given though it never tokenizes here."""
    from tokenizers import Tokenizer, models
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerFast

    ids = torch.randint(3, vocab_size, (samples, 1, length), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    return {"dataset": DataLoader(batches, batch_size=None), "processor": tokenizer}


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer whose token i is the word `t<i>` (split on whitespace, decoded joined by spaces), so that
    `overlap serve` can be asked in text for exact token ids and its answer read back as ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(
        folder)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--scheme", choices=SCHEMES, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    log(f"building a random {args.family} model")
    dense = tempfile.TemporaryDirectory(prefix="dense-")
    model = random_model(args.family, Path(dense.name))
    log(f"oneshot with QuantizationModifier({SCHEMES[args.scheme]})")
    ignore = ["lm_head", *([ROUTERS[args.family]] if args.family in ROUTERS else [])]
    recipe = QuantizationModifier(targets="Linear", ignore=ignore, **SCHEMES[args.scheme])
    data = calibration(model.config.vocab_size) if args.scheme in CALIBRATED else {}
    oneshot(model=model, recipe=recipe, **data)
    log(f"saving compressed to {args.out}")
    model.save_pretrained(args.out, save_compressed=True)
    save_word_tokenizer(args.out, SIZE["vocab_size"])
    config = json.loads((args.out / "config.json").read_text())
    dense.cleanup()
    log(f"wrote format {config['quantization_config']['format']}: {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
    main()
