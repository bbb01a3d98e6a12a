"""`tiny-copy`: a model that quotes its context, for speculative decoding's benchmarks and tests.

The tiny default model has random weights: its output never repeats its prompt, so a prompt-lookup proposer has
nothing to find there. This folder has the tiny model's shape (config, tokenizer, every weight matrix: a step costs
what a tiny-model step costs) with weights set by hand to an induction circuit, the mechanism trained models quote
with:

- every token's embedding is a constant (dimension 0) and a random unit code of CODE_DIM numbers;
- layer 0, head 0 attends to the previous position (its queries and keys are constants, rotated by RoPE's fastest
  frequencies so that their product peaks at distance 1) and writes the previous token's code to a second subspace;
- layer 1, head 0 matches the current token's code against that subspace, in RoPE's slowest frequencies (rope_theta
  1e8: nearly unrotated over the context), so it attends to the positions right after earlier occurrences of the
  current token, and writes the code of the token there to a third subspace;
- the LM head scores every token's code against that subspace; everything else is zero.

So the next token is the one that followed the current token's latest occurrences (greedy quotes a repeated prompt
exactly); with no earlier occurrence it is whichever token follows the most similar code, a token of the context.
"""

from __future__ import annotations

import math
from pathlib import Path

MODEL_NAME = "tiny-copy-v1"  # bump when the recipe changes
ROPE_THETA = 1e8
CODE_DIM = 32
SEED = 4321
# residual stream layout: [0] constant, then the three code subspaces
_CODE, _PREV, _OUT = 64, 128, 192
# layer 0's previous-token head: RoPE pairs 0..5 (the fastest frequencies), weighted
_PREV_PAIRS = range(6)
_PREV_SCORE = 60.0  # its attention logit at distance 1 (the next best is lower by ~12%)
_MATCH_SCORE = 40.0  # layer 1's attention logit for a matching code
_HEAD_GAIN = 25.0  # the LM head's logit for the quoted token


def copy_model_dir() -> Path:
    from overlap.engine.model.builder import cache_root

    return cache_root() / MODEL_NAME


def ensure_copy_model() -> Path:
    """Build the copying model once into the cache and return its folder."""
    from overlap.engine.model.builder import build_model_folder

    return build_model_folder(copy_model_dir(), _write_model, "the copying model")


def _write_model(target: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from overlap.engine.model.builder import load_tokenizer, make_tokenizer_config_portable, tiny_config

    config = tiny_config(rope_theta=ROPE_THETA)
    tokenizer = load_tokenizer()
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        _set_weights(model, config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    make_tokenizer_config_portable(target / "tokenizer_config.json")


def _set_weights(model, config) -> None:
    import torch

    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = hidden // config.num_attention_heads
    half = head_dim // 2
    generator = torch.Generator().manual_seed(SEED)
    codes = torch.randn(vocab, CODE_DIM, generator=generator)
    codes /= codes.norm(dim=1, keepdim=True)
    code = slice(_CODE, _CODE + CODE_DIM)
    prev = slice(_PREV, _PREV + CODE_DIM)
    out = slice(_OUT, _OUT + CODE_DIM)

    inner = model.model
    inner.embed_tokens.weight[:, 0] = 1.0
    inner.embed_tokens.weight[:, code] = codes
    for layer in inner.layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    inner.norm.weight.fill_(1.0)

    # RMSNorm scales a row to rms 1: the constant and each unit code then read as sqrt(hidden / n) for n filled parts
    def scale(num_parts: int) -> float:
        return math.sqrt(hidden / num_parts)

    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    # layer 0, head 0: q = (w, 0), k = w (cos t, sin t) per pair: q.k after RoPE = sum w^2 cos(t (d - 1)) / sqrt(hd)
    attn = inner.layers[0].self_attn
    s0 = scale(2)  # constant + code
    pairs = list(_PREV_PAIRS)
    w = math.sqrt(_PREV_SCORE * math.sqrt(head_dim) / len(pairs)) / s0
    for m in pairs:
        theta = float(inv_freq[m])
        attn.q_proj.weight[m, 0] = w
        attn.k_proj.weight[m, 0] = w * math.cos(theta)
        attn.k_proj.weight[m + half, 0] = w * math.sin(theta)
    attn.v_proj.weight[:CODE_DIM, code] = torch.eye(CODE_DIM) / s0
    attn.o_proj.weight[prev, :CODE_DIM] = torch.eye(CODE_DIM)

    # layer 1, head 0: the code against the previous token's code, in the slowest pairs (head dims half-16.. and the
    # same in the second half), then the code of the attended token
    attn = inner.layers[1].self_attn
    s1 = scale(3)  # constant + code + previous code
    dims = list(range(half - CODE_DIM // 2, half)) + list(range(head_dim - CODE_DIM // 2, head_dim))
    b = math.sqrt(_MATCH_SCORE * math.sqrt(head_dim)) / s1
    for j, d in enumerate(dims):
        attn.q_proj.weight[d, _CODE + j] = b
        attn.k_proj.weight[d, _PREV + j] = b
    attn.v_proj.weight[:CODE_DIM, code] = torch.eye(CODE_DIM) / s1
    attn.o_proj.weight[out, :CODE_DIM] = torch.eye(CODE_DIM)

    s2 = scale(4)  # constant + three codes
    model.lm_head.weight[:, out] = codes * (_HEAD_GAIN / s2)


def prev_head_margin(context: int = 4096, head_dim: int = 64) -> float:
    """How much lower than at distance 1 layer 0's attention logit is at any other distance up to `context` (the
    previous-token head is sharp if this is well above 0)."""
    pairs = list(_PREV_PAIRS)
    freqs = [1.0 / ROPE_THETA ** (2 * m / head_dim) for m in pairs]
    best = len(pairs)
    other = max(sum(math.cos(f * (d - 1)) for f in freqs) for d in range(context) if d != 1)
    return (best - other) / best * _PREV_SCORE
