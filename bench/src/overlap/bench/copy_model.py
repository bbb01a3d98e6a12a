"""`tiny-copy` (and `<shape>-copy`): models that quote their context, for speculative decoding's benchmarks and tests.

The tiny default model and the `--model-shape` folders have random weights: their output never repeats the prompt,
so a prompt-lookup proposer has nothing to find. These folders have the same shape (config dimensions, tokenizer,
every weight matrix: a step costs what the random model's step costs) with weights set by hand to an induction
circuit, the mechanism trained models quote with:

- every token's embedding is a constant (dimension 0) and a random unit code of CODE_DIM numbers;
- layer 0, head 0 attends to the previous position (its queries and keys are constants, rotated by RoPE's fastest
  frequencies so that their product peaks at distance 1) and writes the previous token's code to a second subspace;
- layer 1, head 0 matches the current token's code against that subspace, in RoPE's slowest frequencies (rope_theta
  1e8: nearly unrotated over the context), so it attends to the positions right after earlier occurrences of the
  current token, and adds the code of the token there to the code subspace; a head of the next KV group attends to
  its own position and subtracts the current token's code, so the code subspace ends up holding the quoted token's;
- the LM head is the embedding (tied or not): it scores every token's code against that subspace. Every other
  weight is zero (and the layers past the second pass the residual on).

So the next token is the one that followed the current token's earlier occurrences (greedy quotes a repeated prompt
exactly); with no earlier occurrence it is whichever token follows the most similar code, a token of the context.
A real shape's folder keeps its dimensions but is written as its family's architecture with rope_theta 1e8 and no
RoPE scaling (which change no cost).
"""

from __future__ import annotations

import math
from pathlib import Path

MODEL_NAME = "tiny-copy-v2"  # bump when the recipe changes
ROPE_THETA = 1e8
CODE_DIM = 32
SEED = 4321
# residual stream layout: [0] constant, then two code subspaces: the current (then the quoted) token's, the previous
_CODE, _PREV = 64, 128
_POS_PAIRS = range(6)  # the positional heads' RoPE pairs (the fastest frequencies)
_POS_SCORE = 60.0  # their attention logit at their distance (elsewhere lower by at least `prev_head_margin`)
_MATCH_SCORE = 40.0  # the induction head's attention logit for a matching code
_HEAD_GAIN = 25.0  # the LM head's logit for the quoted token


def copy_model_dir(shape: str | None = None) -> Path:
    from overlap.engine.model.builder import cache_root

    return cache_root() / (MODEL_NAME if shape is None else f"copy/{shape}-copy-v2")


def ensure_copy_model(shape: str | None = None, progress=None) -> Path:
    """Build the copying model of the tiny shape (or of `overlap model build-shape`'s `shape`) once into the cache
    and return its folder."""
    from overlap.engine.model.builder import build_model_folder

    if progress is not None and shape is not None and not (copy_model_dir(shape) / "config.json").is_file():
        progress(f"building the copying model of {shape} (once, into {copy_model_dir(shape)})")
    return build_model_folder(copy_model_dir(shape), lambda target: _write_model(target, shape), "a copying model")


def _write_model(target: Path, shape: str | None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from overlap.engine.model import builder

    if shape is None:
        config = builder.tiny_config(rope_theta=ROPE_THETA)
    else:
        from overlap.engine.model.shapes import shape_config

        fields = {k: v for k, v in shape_config(shape).items() if k not in ("architectures", "rope_scaling")}
        config = AutoConfig.for_model(fields.pop("model_type"), **{**fields, "rope_theta": ROPE_THETA})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        set_copy_weights(model, config)
    if shape is not None:
        model.to(torch.bfloat16)  # as the real checkpoints ship
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(target, safe_serialization=True)
    if shape is None:
        tokenizer = builder.load_tokenizer()
        tokenizer.save_pretrained(target)
        builder.make_tokenizer_config_portable(target / "tokenizer_config.json")
    else:
        from overlap.engine.model.shapes import _write_tokenizer  # the shape's own: tiny's, padded to its vocabulary

        _write_tokenizer(target, config.vocab_size)


def set_copy_weights(model, config) -> None:
    """Write the induction circuit into a zeroed Llama-family model (GQA, biases, tied embeddings all fine)."""
    import torch

    hidden, vocab = config.hidden_size, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    half, group = head_dim // 2, heads // kv_heads
    assert kv_heads >= 2 and hidden >= _PREV + CODE_DIM and half >= CODE_DIM // 2 + len(_POS_PAIRS), "too small"
    generator = torch.Generator().manual_seed(SEED)
    codes = torch.randn(vocab, CODE_DIM, generator=generator)
    codes /= codes.norm(dim=1, keepdim=True)
    code = slice(_CODE, _CODE + CODE_DIM)
    prev = slice(_PREV, _PREV + CODE_DIM)
    eye = torch.eye(CODE_DIM)

    # RMSNorm scales a row to rms 1: a residual of n parts, each of norm `alpha`, reads as sqrt(hidden / n) per part.
    # Every part is written with norm alpha, so that the tied LM head (the embedding) gives the quoted token
    # _HEAD_GAIN over the rest at the end, where the residual has 3 parts.
    def scale(num_parts: int) -> float:
        return math.sqrt(hidden / num_parts)

    alpha = _HEAD_GAIN / scale(3)
    inner = model.model
    inner.embed_tokens.weight[:, 0] = alpha
    inner.embed_tokens.weight[:, code] = codes * alpha
    if model.lm_head.weight is not inner.embed_tokens.weight:
        model.lm_head.weight.copy_(inner.embed_tokens.weight)
    for layer in inner.layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    inner.norm.weight.fill_(1.0)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def positional_head(attn, q_head: int, distance: int, num_parts: int) -> None:
        """q = (w, 0), k = w (cos dt, sin dt) per pair, from the constant: q.k after RoPE = sum w^2 cos(t (d -
        distance)) / sqrt(head_dim), largest at the given distance."""
        s = scale(num_parts)
        w = math.sqrt(_POS_SCORE * math.sqrt(head_dim) / len(_POS_PAIRS)) / s
        q0, k0 = q_head * head_dim, (q_head // group) * head_dim
        for m in _POS_PAIRS:
            theta = float(inv_freq[m]) * distance
            attn.q_proj.weight[q0 + m, 0] = w
            attn.k_proj.weight[k0 + m, 0] = w * math.cos(theta)
            attn.k_proj.weight[k0 + m + half, 0] = w * math.sin(theta)

    def copy_value(attn, q_head: int, num_parts: int, to: slice, sign: float) -> None:
        """The attended token's code (from the code subspace), added to `to` with norm alpha (times sign)."""
        v0 = (q_head // group) * head_dim
        attn.v_proj.weight[v0 : v0 + CODE_DIM, code] = eye / scale(num_parts)
        o0 = q_head * head_dim
        attn.o_proj.weight[to, o0 : o0 + CODE_DIM] = eye * (sign * alpha)

    # layer 0: the previous token's code into `prev`
    attn = inner.layers[0].self_attn
    positional_head(attn, 0, 1, 2)  # constant + code
    copy_value(attn, 0, 2, prev, 1.0)
    # layer 1: head 0 matches the code against `prev` in the slowest pairs and adds the code found after it ...
    attn = inner.layers[1].self_attn
    dims = list(range(half - CODE_DIM // 2, half)) + list(range(head_dim - CODE_DIM // 2, head_dim))
    b = math.sqrt(_MATCH_SCORE * math.sqrt(head_dim)) / scale(3)  # constant + code + previous code
    for j, d in enumerate(dims):
        attn.q_proj.weight[d, _CODE + j] = b
        attn.k_proj.weight[d, _PREV + j] = b
    copy_value(attn, 0, 3, code, 1.0)
    # ... and the first head of the next KV group subtracts the current token's code (it attends to itself)
    positional_head(attn, group, 0, 3)
    copy_value(attn, group, 3, code, -1.0)


def prev_head_margin(context: int = 4096, head_dim: int = 64) -> float:
    """How much lower than at its own distance a positional head's attention logit is at any other distance up to
    `context` (the head is sharp if this is well above 0)."""
    freqs = [1.0 / ROPE_THETA ** (2 * m / head_dim) for m in _POS_PAIRS]
    best = len(freqs)
    other = max(sum(math.cos(f * d) for f in freqs) for d in range(1, context))
    return (best - other) / best * _POS_SCORE
