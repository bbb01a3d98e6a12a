"""Read a local Hugging Face model folder's config.json (and generation_config.json) into a `ModelSpec`: the fields
the forward pass needs, checked and normalized across the supported families.

Supported: the Llama family, the mixtures of experts and Gemma 1-3 (text) as transformers defines them (see
`SUPPORTED_ARCHITECTURES`), in float weights or in the quantized formats of `quant/formats.py`. Everything else, and
every config the runner would compute wrongly (an unknown quantization, an activation it lacks, a rope it cannot
compute), raises ModelLoadError saying why. loader.py then reads the weights for the spec.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from overlap.engine.errors import ModelLoadError
from overlap.engine.model import experts as moe_experts
from overlap.engine.model.quant import formats as quant_formats

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
}

# Families people try that this runner would compute wrongly: refused by name, with the reason.
REFUSED_FAMILIES = {
    "gemma3n": "Gemma 3n (per-layer embeddings, AltUp, LAuReL) is not implemented",
    "recurrent": "recurrent models (RecurrentGemma's Griffin blocks) are not implemented",
    "moe": "this mixture-of-experts family is not implemented (Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss are)",
    "deepseek": "DeepSeek models (mixture of experts, multi-head latent attention) are not implemented",
    "vl": "multimodal models are not implemented (text-only causal LMs are)",
    "llava": "multimodal models are not implemented (text-only causal LMs are)",
    "vision": "multimodal models are not implemented (text-only causal LMs are)",
}

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# attention_bias: q, k, v and o biases
_ATTENTION_BIAS_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")

# Windows only with use_sliding_window (transformers drops sliding_window without it)
_USE_SLIDING_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

_GEMMA_ARCHS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")


@dataclass(slots=True)
class ModelSpec:
    """The config.json fields the forward pass needs, checked and normalized across the supported families."""

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
    qkv_bias: bool  # biases on q, k and v
    o_bias: bool  # a bias on the output projection (Llama's attention_bias sets both)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before RoPE
    layer_windows: list[int | None]  # per layer: its sliding window, or None for full attention
    rope_type: str
    rope_context_cap: int | None  # dynamic / longrope: equal to transformers only up to this many positions
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    # generation_config.json's sampling defaults (temperature, top_p, top_k), applied where a request leaves them out
    sampling_defaults: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)  # the whole config.json
    quantization: quant_formats.QuantFormat | None = None  # None: float weights
    moe: moe_experts.MoeSpec | None = None  # a mixture of experts' routing and sparse layers (None: dense)
    # What Gemma's decoder computes differently from Llama's (the defaults are Llama's): see models/gemma.py.
    hidden_act: str = "silu"  # the gated MLP's activation, transformers' name: silu or gelu_pytorch_tanh (GeGLU)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's 1 + w
    feedforward_norms: bool = False  # Gemma 2/3: a norm before and after the MLP, and one on the attention's output
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: scores scaled by its -1/2 power (None: head_dim's)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcapping: float | None = None  # Gemma 2/3: the same on the logits
    # Gemma 3: the RoPE parameters of each layer type ("full_attention", "sliding_attention"); None: one for all
    rope_by_layer_type: dict[str, dict] | None = None
    # gpt-oss: a learned logit per query head in each attention softmax's denominator (`self_attn.sinks`)
    attention_sinks: bool = False
    norm_fp32: bool = False  # gpt-oss: RMSNorm multiplies by its weight in fp32 and rounds once (Gemma's do too)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers (None when every layer attends fully)."""
        return next((w for w in self.layer_windows if w is not None), None)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _architecture(cfg: dict, config_path: Path) -> str:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(cfg.get("model_type", ""))
    if arch is not None:
        return arch
    name = ", ".join(archs) or repr(cfg.get("model_type"))
    lowered = (name + " " + str(cfg.get("model_type", ""))).lower()
    reason = next((why for key, why in REFUSED_FAMILIES.items() if key in lowered), None)
    if reason is None and ("vision_config" in cfg or "ForConditionalGeneration" in name):
        reason = REFUSED_FAMILIES["vision"]
    reason = reason or "this architecture is not implemented"
    raise ModelLoadError(
        f"unsupported architecture {name} in {config_path}: {reason}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _layer_windows(cfg: dict, arch: str, num_layers: int, config_path: Path) -> list[int | None]:
    window = cfg.get("sliding_window")
    if arch in ("LlamaForCausalLM", "GemmaForCausalLM") or not window or (
            arch in _USE_SLIDING_ARCHS and not cfg.get("use_sliding_window")):  # fmt: skip
        return [None] * num_layers
    window = int(window)
    types = cfg.get("layer_types")
    if types is None:
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # transformers' rule when layer_types is absent
            first_sliding = int(cfg.get("max_window_layers", num_layers)) if cfg.get("use_sliding_window") else None
            types = ["sliding_attention" if first_sliding is not None and i >= first_sliding else "full_attention"
                     for i in range(num_layers)]  # fmt: skip
        elif arch == "Qwen2MoeForCausalLM":  # its own rule: every other layer below max_window_layers
            below = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if i % 2 == 0 and i < below else "full_attention" for i in range(num_layers)]
        elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"):  # every pattern-th one full
            pattern = int(cfg.get("sliding_window_pattern") or 6) if arch == "Gemma3ForCausalLM" else 2
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:  # Mistral, Phi-3, Mixtral, Qwen3-MoE: every layer slides
            types = ["sliding_attention"] * num_layers
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{config_path}: layer_types {types!r} must name full_attention or sliding_attention "
                             f"for each of the {num_layers} layers")  # fmt: skip
    return [window if t == "sliding_attention" else None for t in types]


def _rope(cfg: dict, arch: str, config_path: Path) -> tuple[str, int | None, dict[str, dict] | None]:
    """The RoPE type (of the full-attention layers, where each layer type has its own: Gemma 3's parameters by layer
    type come third) and the context it caps serving at (None: no cap)."""
    by_layer_type = _gemma3_rope(cfg) if arch == "Gemma3ForCausalLM" else None
    one = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kinds = [one] if by_layer_type is None else list(by_layer_type.values())  # the full-attention layers' first
    types, caps = [], []
    for params in kinds:
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"{config_path}: RoPE type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        types.append(rope_type)
        if rope_type in ("dynamic", "longrope"):
            # transformers recomputes these frequencies per forward once a sequence outgrows the original context
            # (and keeps the K already cached); up to that length both equal their static tables, so the served
            # context stops there.
            caps.append(int(params.get("original_max_position_embeddings")
                            or cfg.get("original_max_position_embeddings")
                            or cfg.get("max_position_embeddings", 2048)))  # fmt: skip
    return types[0], min(caps, default=None), by_layer_type


def _gemma3_rope(cfg: dict) -> dict[str, dict]:
    """Gemma 3's RoPE per layer type, as transformers 5 reads config.json (Gemma3TextConfig): rope_parameters by
    layer type, or a 4.x config's rope_theta and rope_scaling for the full-attention layers and rope_local_base_freq
    for the sliding ones."""
    params = cfg.get("rope_parameters") or {}
    full = {"rope_type": "default", **(params.get("full_attention") or {}), **(cfg.get("rope_scaling") or {})}
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1_000_000.0)
    sliding = {"rope_type": "default", **(params.get("sliding_attention") or {})}
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10_000.0)
    for kind in (full, sliding):  # 4.x spelled the type "type"
        kind["rope_type"] = kind.pop("type", None) or kind["rope_type"]
    return {"full_attention": full, "sliding_attention": sliding}


def _hidden_act(cfg: dict, arch: str, config_path: Path) -> str:
    """The gated MLP's activation by transformers' name: SwiGLU's silu, or Gemma's GeGLU (gelu_pytorch_tanh)."""
    if arch not in _GEMMA_ARCHS:
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"{config_path}: hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")
        return "silu"
    # Gemma 1 reads hidden_act (GemmaConfig turns its legacy "gelu" into the tanh approximation); 2 and 3 read
    # hidden_activation
    if arch == "GemmaForCausalLM":
        key, act = "hidden_act", cfg.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    else:
        key, act = "hidden_activation", cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{config_path}: {key} {act!r} is not supported (Gemma's MLP is GeGLU: "
                             "gelu_pytorch_tanh)")  # fmt: skip
    return act


def _gemma_fields(cfg: dict, arch: str, config_path: Path) -> dict:
    """The ModelSpec fields in which Gemma 1, 2 and 3 differ from Llama (none for the other families)."""
    if arch not in _GEMMA_ARCHS:
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{config_path}: use_bidirectional_attention (an encoder, e.g. EmbeddingGemma) is not "
                             "supported: this engine serves causal LMs")  # fmt: skip
    if arch == "GemmaForCausalLM":
        return {"norm_weight_offset": 1.0}
    if arch == "Gemma3ForCausalLM" and not cfg.get("sliding_window"):
        # transformers would still give its sliding layers their own RoPE, with attention that does not slide
        raise ModelLoadError(f"{config_path}: Gemma 3 without a sliding_window is not supported")

    def cap(key: str) -> float | None:
        return float(cfg[key]) if cfg.get(key) else None

    return {
        "norm_weight_offset": 1.0,
        "feedforward_norms": True,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        # transformers' Gemma 3 attention never passes attn_logit_softcapping on: its scores are not capped
        "attn_logit_softcapping": cap("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
        "final_logit_softcapping": cap("final_logit_softcapping"),
    }


# Keys a family's transformers config class fills in, with a default of that family, when config.json leaves them out
# (every release sets them; a trimmed or hand-written config may not): read from that class where absent, so the
# engine computes what transformers does with the same folder.
_CLASS_DEFAULTS = {
    "Gemma2ForCausalLM": ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "head_dim",
                          "query_pre_attn_scalar", "rope_parameters"),
    "GptOssForCausalLM": ("sliding_window", "head_dim", "rms_norm_eps", "rope_parameters"),
    "MixtralForCausalLM": ("rms_norm_eps", "rope_parameters"),
}  # fmt: skip


def _with_class_defaults(cfg: dict, arch: str, model_dir: Path) -> dict:
    missing = [key for key in _CLASS_DEFAULTS.get(arch, ()) if key not in cfg]
    if "rope_parameters" in missing and ({"rope_theta", "rope_scaling"} & cfg.keys()):
        missing.remove("rope_parameters")  # a 4.x config's RoPE keys: read as they are
    if not missing:
        return cfg
    from transformers import AutoConfig

    try:
        full = AutoConfig.from_pretrained(model_dir).to_dict()
    except Exception as exc:  # transformers refuses the config: say so, as for any unreadable config.json
        raise ModelLoadError(f"{model_dir / 'config.json'}: transformers cannot read it: {exc}") from exc
    return {**cfg, **{key: full[key] for key in missing if full.get(key) is not None}}


def read_spec(model_dir: Path, quantization: str | None = None) -> ModelSpec:
    """config.json's spec; `quantization` (--quantization) refuses a checkpoint of another format."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist (or is not a folder)")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    cfg = read_json(config_path)
    arch = _architecture(cfg, config_path)
    cfg = _with_class_defaults(cfg, arch, model_dir)
    quant = quant_formats.parse(cfg, config_path, quantization)
    if quant is not None and quant.method == "mxfp4" and arch != "GptOssForCausalLM":
        raise ModelLoadError(f"{config_path}: MXFP4 weights are supported for gpt-oss's experts only, not {arch}")
    act = _hidden_act(cfg, arch, config_path)
    gen_path = model_dir / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        # Every EOS id either file declares stops generation (Llama 3 Instruct lists two in generation_config.json).
        eos_ids = list(dict.fromkeys(_ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}
        # GptOssConfig's default is True (its q, k, v and o always have biases in the released checkpoints)
        attention_bias = bool(cfg.get("attention_bias", arch == "GptOssForCausalLM"))
        moe_qkv_bias = arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))  # Qwen2-MoE's own key
        rope_type, rope_cap, rope_by_layer_type = _rope(cfg, arch, config_path)
        return ModelSpec(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in _GEMMA_ARCHS)),  # their configs' default
            # What each family's transformers module builds: Mistral and Phi-3 ignore attention_bias.
            qkv_bias=arch == "Qwen2ForCausalLM"
            or (attention_bias and arch in _ATTENTION_BIAS_ARCHS + _GEMMA_ARCHS)
            or moe_qkv_bias,
            o_bias=attention_bias and arch in _ATTENTION_BIAS_ARCHS + _GEMMA_ARCHS,
            mlp_bias=bool(cfg.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            layer_windows=_layer_windows(cfg, arch, num_layers, config_path),
            rope_type=rope_type,
            rope_context_cap=rope_cap,
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=eos_ids,
            sampling_defaults=defaults,
            raw=cfg,
            quantization=quant,
            moe=moe_experts.read_moe_spec(cfg, arch, num_layers, config_path, quant),
            hidden_act=act,
            rope_by_layer_type=rope_by_layer_type,
            attention_sinks=arch == "GptOssForCausalLM",
            norm_fp32=arch == "GptOssForCausalLM",
            **_gemma_fields(cfg, arch, config_path),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path} lacks or mangles a required field: {exc!r}") from exc


def rope_tables(spec: ModelSpec, max_len: int, model_dir: Path,
                layer_type: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """cos and sin, [max_len, rotary_dim] in fp32 in transformers' rotate-half layout, computed as transformers does
    (fp32 frequencies times fp32 positions, then its attention scaling). rotary_dim < head_dim: partial rotary.
    `layer_type` picks the table of that kind of layer where kinds have their own (`spec.rope_by_layer_type`)."""
    by_type = spec.rope_by_layer_type
    params = by_type[layer_type] if by_type else spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    rope_type = params["rope_type"] if by_type else spec.rope_type
    partial = float(params.get("partial_rotary_factor") or spec.raw.get("partial_rotary_factor") or 1.0)
    scaling = 1.0
    if rope_type == "default":
        theta = float(params.get("rope_theta") or spec.raw.get("rope_theta") or 10000.0)
        dim = int(spec.head_dim * partial)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:  # transformers knows every variant; only then pay for its import
        try:
            from transformers import AutoConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            kind = {"layer_type": layer_type} if by_type else {}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.from_pretrained(model_dir), "cpu", **kind)
        except Exception as exc:
            raise ModelLoadError(f"cannot compute RoPE type {rope_type!r}: {exc}") from exc
    angles = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize


def blocks_for_bytes(num_bytes: float, block_size: int, bytes_per_token: int) -> int:
    return max(1, math.floor(num_bytes / (block_size * bytes_per_token)))
