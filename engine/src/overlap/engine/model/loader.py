"""Read a local Hugging Face Llama-family folder (config.json + *.safetensors) into plain tensors.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (Qwen2's q/k/v biases, tied embeddings, grouped
query attention). Anything else raises ModelLoadError with the reason. The weights come back already fused for the
runner: one q|k|v matrix and one gate|up matrix per layer, so each layer runs four matmuls.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from overlap.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(slots=True)
class ModelSpec:
    """The few config.json fields the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict = field(default_factory=dict)  # the whole config.json, for RoPE variants


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*KV) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None once the runner split it into gate and up
    down: torch.Tensor
    gate: torch.Tensor | None = None  # the runner's oneDNN path: gate (SiLU fused into its matmul) and up apart
    up: torch.Tensor | None = None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor


def read_spec(model_dir: Path) -> ModelSpec:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist (or is not a folder)")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {config_path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():  # generation_config's eos (often a list) wins, as in transformers' generate
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            eos = gen_eos if gen_eos is not None else eos
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
        sliding = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            sliding = None
        return ModelSpec(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path} lacks or mangles a required field: {exc!r}") from exc


def rope_tables(spec: ModelSpec, max_len: int, model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_len, head_dim] in fp32, in transformers' rotate-half layout (computed once)."""
    params = spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or spec.raw.get("rope_theta") or 10000.0)
    scaling = 1.0
    if rope_type == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim))
    else:  # llama3, linear, yarn, ...: transformers knows them all; only then pay for its import
        try:
            from transformers import AutoConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.from_pretrained(model_dir), "cpu")
            inv_freq = inv_freq.to(torch.float64)
        except Exception as exc:
            raise ModelLoadError(f"unsupported RoPE type {rope_type!r}: {exc}") from exc
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq).float()
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def load_weights(spec: ModelSpec, model_dir: Path, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weight files (only safetensors checkpoints load)")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensors[name] = f.get_tensor(name)
    except Exception as exc:
        raise ModelLoadError(f"cannot read weights from {model_dir}: {exc}") from exc

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{model_dir}: weight {name!r} is missing")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{model_dir}: weight {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.to(device=device, dtype=dtype)

    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    layers = []
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        qkv = torch.cat(
            [
                take(p + "self_attn.q_proj.weight", (q_out, h)),
                take(p + "self_attn.k_proj.weight", (kv_out, h)),
                take(p + "self_attn.v_proj.weight", (kv_out, h)),
            ]
        )
        bias = None
        if spec.attention_bias:
            bias = torch.cat(
                [
                    take(p + "self_attn.q_proj.bias", (q_out,)),
                    take(p + "self_attn.k_proj.bias", (kv_out,)),
                    take(p + "self_attn.v_proj.bias", (kv_out,)),
                ]
            )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight", (h,)),
                qkv=qkv,
                qkv_bias=bias,
                o=take(p + "self_attn.o_proj.weight", (h, q_out)),
                post_norm=take(p + "post_attention_layernorm.weight", (h,)),
                gate_up=torch.cat([take(p + "mlp.gate_proj.weight", (i, h)), take(p + "mlp.up_proj.weight", (i, h))]),
                down=take(p + "mlp.down_proj.weight", (h, i)),
            )
        )
    embed = take("model.embed_tokens.weight", (spec.vocab_size, h))
    if "lm_head.weight" in tensors and not spec.tie_word_embeddings:
        lm_head = take("lm_head.weight", (spec.vocab_size, h))
    else:
        lm_head = embed
    return ModelWeights(embed=embed, layers=layers, norm=take("model.norm.weight", (h,)), lm_head=lm_head)


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize


def blocks_for_bytes(num_bytes: float, block_size: int, bytes_per_token: int) -> int:
    return max(1, math.floor(num_bytes / (block_size * bytes_per_token)))
