"""Models of real families' shapes with random weights, for measuring speed at the sizes people serve.

Each shape is the published config.json of a real checkpoint (layer counts, widths, heads, GQA, RoPE, tying, the
vocabulary size); its weights are random (Normal(0, 0.02), norms that scale by 1, as transformers initialises: Gemma's
store 0, they scale by 1 + w) and its tokenizer
is the tiny model's, padded with placeholder tokens up to the real vocabulary so that every id the LM head can pick
decodes, and the embedding and the LM head cost what they cost. Nothing is downloaded. The folder is a complete
Hugging Face checkpoint: `overlap serve`, transformers and vLLM load it alike. Built once into the cache and reused.

With a quantization scheme (`QUANT_SCHEMES`), every decoder projection is written as its producer writes it (random
codes, scales that give the same spread of weights): w4a16, w8a8 and fp8 (FP8_DYNAMIC: one scale per row, per-token
FP8 activations) as llm-compressor writes them in compressed-tensors' format; fp8-block as the DeepSeek-V3 and Qwen3
FP8 releases ship theirs (`quant_method: fp8`, a scale per 128x128 block). The embedding, the norms and the LM head
stay bf16, as those producers leave them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from overlap.engine.errors import ConfigError
from overlap.engine.model import builder

RECIPE = "v2"  # bump when the recipe changes, so cached folders rebuild

_QWEN25 = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, use_sliding_window=False,
)  # fmt: skip
_LLAMA32 = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=True, attention_bias=False,
    mlp_bias=False, rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                  "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
)  # fmt: skip
# Mixtures of experts: every expert's weights are written, so these folders are as large as the real ones (Qwen3-30B-
# A3B: 61 GB in bf16, Mixtral-8x7B: 93 GB), in shards of SHARD_BYTES.
_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
    use_sliding_window=False, sliding_window=None, max_window_layers=48, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
_MIXTRAL = dict(
    architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32000, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, sliding_window=None,
)  # fmt: skip
# openai/gpt-oss-20b as transformers 5 saves it in bf16 (its experts fused, gate and up interleaved; the released
# checkpoint's MXFP4 experts dequantized): 24 layers alternating sliding (window 128) and full, sinks, biases
_GPT_OSS = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, max_position_embeddings=131072,
    rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, attention_bias=True, attention_dropout=0.0,
    sliding_window=128, swiglu_alpha=1.702, swiglu_limit=7.0, router_aux_loss_coef=0.9, output_router_logits=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
)  # fmt: skip
SHARD_BYTES = 4 << 30

# name -> the config.json fields of the real checkpoint that shape the compute (Qwen2 has q/k/v biases by design).
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {**_QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2},
    "qwen2.5-3b": {**_QWEN25, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2},
    "llama-3.2-1b": {**_LLAMA32, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64},
    "llama-3.2-3b": {**_LLAMA32, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True},
    "mixtral-8x7b": {**_MIXTRAL, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                     "num_experts_per_tok": 2},
    "gpt-oss-20b": {**_GPT_OSS, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
                    "num_experts_per_tok": 4,
                    "layer_types": ["sliding_attention", "full_attention"] * 12},
    # google/gemma-3-1b-pt's config.json as the hub ships it (transformers 4.50's spelling): 5 sliding layers (window
    # 512, RoPE base 1e4) to 1 full one (base 1e6), q/k norms, no soft-capping
    "gemma-3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        attn_logit_softcapping=None, final_logit_softcapping=None,
    ),
}  # fmt: skip

_DTYPE = "bfloat16"  # what the real checkpoints ship; the engine casts to the dtype asked for at load
_SEED = 4321

# llm-compressor's presets, as its W4A16 and W8A8 schemes write them into config.json (compressed-tensors 0.19)
_W4A16 = {
    "format": "pack-quantized",
    "input_activations": None,
    "targets": ["Linear"],
    "weights": {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": 128,
        "dynamic": False,
    },
}
_W8A8 = {
    "format": "int-quantized",
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
}
_FP8_DYNAMIC = {
    "format": "float-quantized",
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
}


def _compressed_tensors(group: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": group["format"], "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
            "sparsity_config": {}, "version": "0.19.0"}  # fmt: skip


FP8_BLOCK = 128
# name -> the quantization_config its producer writes
QUANT_SCHEMES = {
    "w4a16": _compressed_tensors(_W4A16),
    "w8a8": _compressed_tensors(_W8A8),
    "fp8": _compressed_tensors(_FP8_DYNAMIC),
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    },
}


def shape_config(name: str, quantization: str | None = None, layers: int | None = None) -> dict:
    """The config.json of shape `name`, with the tiny tokenizer's special token ids (and `quantization`'s
    quantization_config); `layers` keeps the first that many decoder layers, the widths unchanged."""
    if name not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}")
    config = {**SHAPES[name], "torch_dtype": _DTYPE, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
              "initializer_range": 0.02}  # fmt: skip
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ConfigError(f"--layers {layers}: shape {name!r} has 1 to {config['num_hidden_layers']} layers")
        config["num_hidden_layers"] = layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:layers]
    if quantization is not None:
        if config["architectures"][0] == "GptOssForCausalLM":
            raise ConfigError(f"shape {name!r}: gpt-oss's experts are fused (released as MXFP4), not a format of "
                              "--quantization")  # fmt: skip
        if quantization not in QUANT_SCHEMES:
            raise ConfigError(f"unknown quantization {quantization!r} for a shape; choose from "
                              f"{', '.join(QUANT_SCHEMES)}")  # fmt: skip
        config["quantization_config"] = dict(QUANT_SCHEMES[quantization])
        if "num_experts_per_tok" in config and "ignore" in config["quantization_config"]:
            # the routers stay float, as llm-compressor's mixture-of-experts examples leave them
            config["quantization_config"]["ignore"] = [*config["quantization_config"]["ignore"], _ROUTERS]
    return config


_ROUTER_BLOCKS = ("mlp", "block_sparse_moe")  # the sparse block whose `gate` is the router: Qwen's, Mixtral's
_ROUTERS = r"re:.*(" + "|".join(_ROUTER_BLOCKS) + r")\.gate$"  # as llm-compressor's `ignore` names them


def _is_router(name: str) -> bool:
    return name.endswith(tuple(f"{block}.gate.weight" for block in _ROUTER_BLOCKS))


def shape_model_dir(name: str, quantization: str | None = None, layers: int | None = None) -> Path:
    """Where shape `name` is cached: `<cache_root>/shapes/<name>[-<quantization>][-L<layers>]-<recipe>`."""
    depth = f"L{layers}" if layers is not None else None
    return builder.cache_root() / "shapes" / "-".join(filter(None, (name, quantization, depth, RECIPE)))


def num_parameters(config: dict) -> int:
    """Parameters of a config's model (the tied LM head counted once)."""
    return sum(math.prod(shape) for shape in _tensor_shapes(config).values())


def ensure_shape_model(name: str, progress: Callable[[str], None] | None = None,
                       quantization: str | None = None, layers: int | None = None) -> Path:  # fmt: skip
    """The folder of shape `name` (its projections in `quantization`'s format, if given; its first `layers` decoder
    layers, if given), built on first use (minutes for the larger shapes; safe when several processes ask at once:
    `builder.build_model_folder` renames it into place whole)."""
    config = shape_config(name, quantization, layers)
    target = shape_model_dir(name, quantization, layers)
    if builder.is_complete(target):
        return target
    started = time.monotonic()
    if progress:
        params = num_parameters(config)
        progress(f"building {name}: {params / 1e9:.2f}B parameters, random weights"
                 + (f" ({quantization})" if quantization else f", {params * 2 / 1e9:.1f} GB"))  # fmt: skip

    def write(folder: Path) -> None:
        _write_weights(folder, config)
        _write_tokenizer(folder, config["vocab_size"])
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")

    builder.build_model_folder(target, write, f"the {name} shape")
    if progress:
        progress(f"built {name} in {time.monotonic() - started:.0f} s: {target}")
    return target


def _tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a Llama-family (or Gemma 3, or gpt-oss) checkpoint of this config (a
    mixture of experts' as the Hub's files hold them: one tensor per expert and projection; gpt-oss's fused)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layers = config["num_hidden_layers"]
    from overlap.engine.model.experts import read_moe_spec  # imports torch: `overlap --help` must start without it

    moe = read_moe_spec(config, config["architectures"][0], layers, Path("config.json"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
        }
        if moe is not None and moe.fused:  # gpt-oss
            m, e, width = f"{p}mlp.", moe.num_experts, moe.intermediate_size
            shapes |= {m + "router.weight": (e, h), m + "router.bias": (e,),
                       m + "experts.gate_up_proj": (e, h, 2 * width), m + "experts.gate_up_proj_bias": (e, 2 * width),
                       m + "experts.down_proj": (e, width, h), m + "experts.down_proj_bias": (e, h),
                       p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,),
                       p + "self_attn.sinks": (heads,)}  # fmt: skip
        elif moe is not None and moe.sparse[i]:
            m, width, (gate, up, down) = f"{p}{moe.prefix}.", moe.intermediate_size, moe.names
            shapes[m + "gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes |= {f"{m}experts.{e}.{gate}.weight": (width, h), f"{m}experts.{e}.{up}.weight": (width, h),
                           f"{m}experts.{e}.{down}.weight": (h, width)}  # fmt: skip
        else:
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}  # fmt: skip
        if config["model_type"] in ("qwen3", "qwen3_moe"):
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        if config["model_type"] == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}  # fmt: skip
        if config["model_type"] == "gemma3_text":
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,),
                       p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,)}  # fmt: skip
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def _write_weights(folder: Path, config: dict) -> None:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(_SEED)
    quantization = config.get("quantization_config") or {}
    shapes = _tensor_shapes(config)
    unit_norm = 0.0 if config["model_type"].startswith("gemma") else 1.0  # Gemma's norms scale by 1 + w
    # Shards of at most SHARD_BYTES (bf16 sizes), each written as soon as it is made: a large model is never whole
    # in memory. One shard: model.safetensors; more: model-0000N-of-0000M.safetensors and their index.
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for index, names in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if name.endswith("norm.weight"):
                tensors[name] = torch.full(shape, unit_norm, dtype=torch.bfloat16)
            elif name.endswith((".bias", "_bias")):
                tensors[name] = torch.zeros(shape, dtype=torch.bfloat16)
            elif quantization and name.startswith("model.layers.") and not _is_router(name):
                module = name.removesuffix(".weight")
                tensors |= {f"{module}.{k}": v for k, v in _quantized(shape, quantization, generator).items()}
            else:
                tensors[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total += sum(t.nbytes for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _quantized(shape: tuple[int, int], quantization: dict, generator) -> dict:
    """Random codes of one projection in the layout `quantization` names, scaled so that the weights spread as
    Normal(0, 0.02) does."""
    import torch

    n, k = shape
    if quantization["quant_method"] == "fp8":  # Normal(0, 1) in FP8, 0.02 each block's scale
        values = torch.empty(shape).normal_(0.0, 1.0, generator=generator).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale_inv": torch.full((-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), 0.02)}
    group = quantization["config_groups"]["group_0"]
    if group["format"] == "float-quantized":
        values = torch.empty(shape).normal_(0.0, 1.0, generator=generator).to(torch.float8_e4m3fn)
        return {"weight": values, "weight_scale": torch.full((n, 1), 0.02, dtype=torch.bfloat16)}
    bits = group["weights"]["num_bits"]
    # symmetric around 0 (-7..7 for 4 bits): with -8 among them the mean is -0.5, a common direction in every output
    # that sends every token's router to the same few experts
    codes = torch.randint(1 - 2 ** (bits - 1), 2 ** (bits - 1), shape, generator=generator, dtype=torch.int32)
    spread = 0.02 / float(codes.float().std())
    if group["format"] == "int-quantized":
        return {"weight": codes.to(torch.int8), "weight_scale": torch.full((n, 1), spread, dtype=torch.bfloat16)}
    per_word = 32 // bits  # pack-quantized: codes + 2**(bits-1), little end first, along the inputs
    unsigned = (codes + 2 ** (bits - 1)).to(torch.int64).view(n, k // per_word, per_word)
    words = sum(unsigned[:, :, i] << (bits * i) for i in range(per_word))
    packed = (words - ((words >> 31) << 32)).to(torch.int32)
    scale = torch.full((n, k // group["weights"]["group_size"]), spread, dtype=torch.bfloat16)
    return {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k])}


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """The tiny tokenizer with placeholder tokens `<|extra_N|>` in its vocabulary up to `vocab_size`: encoding never
    produces them (no merges lead there), decoding any id works."""
    tokenizer = builder.load_tokenizer()
    tokenizer.save_pretrained(folder)
    builder.make_tokenizer_config_portable(folder / "tokenizer_config.json")
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    for token_id in range(vocab_size):
        if token_id not in used:
            vocab[f"<|extra_{token_id}|>"] = token_id
    path.write_text(json.dumps(data, ensure_ascii=False))
