"""Tiny random-weight Hugging Face model folders, one per supported family and variant, built from transformers' own
config classes and saved with `save_pretrained` (no download). The conformance matrix (tests/engine/
test_model_conformance.py) and docs/models.md both name the variants by the keys of `VARIANTS`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention everywhere
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    # Wide weights: transformers' default (0.02) leaves the logits of a random model nearly flat, so greedy would
    # hinge on near ties; at 0.2 the top two logits stand apart far beyond fp32 rounding.
    initializer_range=0.2,
)

# gpt-oss's sinks: N(0, SINK_SPREAD) logits, in the range of the scaled scores they join (checked to matter)
SINK_SPREAD = 2.0


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, **kw)


def _rope(rope_type: str, **params) -> dict:
    return {"rope_type": rope_type, "rope_theta": params.pop("rope_theta", 10000.0), **params}


def _variants() -> dict[str, Callable]:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    return {
        "llama": lambda: _llama(tie_word_embeddings=True),
        "llama-linear-rope": lambda: _llama(rope_parameters=_rope("linear", factor=4.0)),
        "llama-dynamic-rope": lambda: _llama(rope_parameters=_rope("dynamic", factor=2.0)),
        "llama-yarn-rope": lambda: _llama(
            rope_parameters=_rope("yarn", factor=4.0, original_max_position_embeddings=128)
        ),
        "llama3-rope": lambda: _llama(
            tie_word_embeddings=True,
            rope_parameters=_rope(
                "llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
        ),
        "llama-longrope": lambda: _llama(
            rope_parameters=_rope(
                "longrope",
                short_factor=[1.0 + 0.1 * i for i in range(8)],
                long_factor=[2.0 + 0.3 * i for i in range(8)],
                original_max_position_embeddings=128,
            )
        ),
        "llama-biases-head-dim": lambda: _llama(attention_bias=True, mlp_bias=True, head_dim=32),
        "mistral-sliding-window": lambda: MistralConfig(**COMMON, sliding_window=32),
        "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen2-sliding-layers": lambda: Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=32, max_window_layers=1
        ),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),
        "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0),
        "phi3-partial-rotary": lambda: Phi3Config(
            **COMMON, pad_token_id=0, rope_parameters=_rope("default", partial_rotary_factor=0.5)
        ),
        # Gemma: head_dim set (their configs default to 256); caps small enough to bend these scores and logits
        "gemma": lambda: GemmaConfig(**COMMON, head_dim=16),
        "gemma2": lambda: Gemma2Config(
            **COMMON,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        # layers: sliding, full (pattern 2); a linear-scaled RoPE on the full layer, base 1e4 on the sliding one; the
        # final soft-capping real Gemma 3 leaves off, which transformers applies when set
        "gemma3": lambda: Gemma3TextConfig(
            **COMMON,
            head_dim=32,
            query_pre_attn_scalar=48,
            sliding_window=32,
            sliding_window_pattern=2,
            final_logit_softcapping=3.0,
            rope_parameters={
                "full_attention": _rope("linear", rope_theta=1e6, factor=2.0),
                "sliding_attention": _rope("default"),
            },
        ),
        **_moe_variants(),
    }


def _moe_variants() -> dict[str, Callable]:
    """Mixtures of experts (the experts' widths differ from COMMON's intermediate_size, the dense layers')."""
    from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    yarn = _rope("yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                 original_max_position_embeddings=64)  # fmt: skip
    gpt_oss = dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=32, swiglu_limit=2.0,
                   rope_parameters=yarn)  # fmt: skip
    return {
        # top-2 of 8 experts renormalised (norm_topk_prob), q/k norms
        "qwen3-moe": lambda: Qwen3MoeConfig(**COMMON, **experts, head_dim=32, norm_topk_prob=True),
        # top-2 of 8 not renormalised, a shared expert with its sigmoid gate, layer 1 a dense MLP (mlp_only_layers)
        "qwen2-moe": lambda: Qwen2MoeConfig(
            **COMMON, **experts, shared_expert_intermediate_size=48, mlp_only_layers=[1]
        ),
        # 4 experts of width 128 (intermediate_size), top-2 (a softmax over the two), every layer sliding (window 32)
        "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
        # 4 experts of width 128 top-2 (a biased router, top-k then softmax), biased experts with the clamped SwiGLU
        # (a limit of 2 so that the clamps bite), attention sinks (save_variant draws them wide), biases on q, k, v
        # and o, a sliding layer (window 32) then a full one, gpt-oss's YaRN (truncate false) over 64 positions x 8,
        # head size 64 as released
        "gpt-oss": lambda: GptOssConfig(**COMMON, **gpt_oss),
    }


VARIANTS = (
    "llama", "llama-linear-rope", "llama-dynamic-rope", "llama-yarn-rope", "llama3-rope", "llama-longrope",
    "llama-biases-head-dim", "mistral-sliding-window", "qwen2", "qwen2-sliding-layers", "qwen3", "phi3",
    "phi3-partial-rotary",
    "qwen3-moe", "qwen2-moe", "mixtral", "gpt-oss",
    "gemma", "gemma2", "gemma3",
)  # fmt: skip


def save_variant(name: str, folder: Path, *, generation_config: dict | None = None) -> Path:
    """Build variant `name` with seeded random weights (biases and norm weights perturbed too: transformers
    initialises them to 0 and 1, which would leave them untested; gpt-oss's attention sinks drawn as wide as the
    scores they join) and save it to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _variants()[name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.3)
            elif param_name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * SINK_SPREAD)
    model.save_pretrained(folder)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def edit_config(folder: Path, **changes) -> Path:
    """Rewrite keys of the folder's config.json (None deletes a key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


def transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' incremental greedy decode (its KV cache, its RoPE updates), with no logits processors: generate's
    min_new_tokens would mask EOS, which the runner, told to ignore EOS, still may pick."""
    import torch

    out = []
    with torch.inference_mode():
        step = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = hf(torch.tensor([[out[-1]]]), cache=step.past_key_values, use_cache=True)
    return out
