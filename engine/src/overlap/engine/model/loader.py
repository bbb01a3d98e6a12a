"""Read a local Hugging Face model folder's weights (*.safetensors) into plain tensors, for the `ModelSpec` that
model_spec.py read from its config.json.

The weights come back already fused for the runner: one q|k|v matrix and one gate|up matrix per layer, so each layer
runs four matmuls; a projection's weight is a `QuantizedWeight` in the formats of `quant/formats.py` (or dequantized
where the format is). Tensors the runner would not use, and quantized tensors without a quantization_config, raise
ModelLoadError saying why. docs/models.md tables what loads and what is refused, and the test covering each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from overlap.engine.errors import ModelLoadError
from overlap.engine.model import experts as moe_experts
from overlap.engine.model.model_spec import ModelSpec, read_json
from overlap.engine.model.quant.weight import QuantizedWeight, as_float, cat_rows, random_quantized

# Tensors a checkpoint may carry that the runner recomputes or does not need.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)

# Parameter names that only quantized checkpoints have (AWQ, GPTQ, bitsandbytes, FP8 scales).
_QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale", "weight_scale_inv", "SCB")

_FLOAT_DTYPES = ("F32", "BF16", "F16")  # safetensors' names for float32, bfloat16 and float16

# safetensors' names of the others, as torch names them (for the refusal's words)
_TORCH_NAMES = {"F64": "float64", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # fmt: skip

Projection = torch.Tensor | QuantizedWeight  # a projection's weight [out, in], float or quantized


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Projection  # [(H + 2*KV) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: Projection
    post_norm: torch.Tensor  # post_attention_layernorm: the MLP's input norm (Gemma 2/3: the attention output's)
    gate_up: Projection  # [2 * intermediate, hidden]
    down: Projection
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D], Qwen3
    k_norm: torch.Tensor | None = None
    moe: moe_experts.ExpertWeights | None = None  # a sparse layer's experts (gate_up and down are then None)
    pre_mlp_norm: torch.Tensor | None = None  # [hidden], Gemma 2/3 (post_norm then norms the attention's output)
    post_mlp_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [heads] in fp32, gpt-oss's attention sinks


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Projection


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's weight map when there is one, else model.safetensors, else
    every *.safetensors but Mistral's consolidated ones (its own format, a duplicate of the HF weights)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not in the folder: {', '.join(missing)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(f for f in model_dir.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        hint = ""
        if any(model_dir.glob("consolidated*.safetensors")):
            hint = " (consolidated.safetensors is Mistral's own format; use the Hugging Face weights)"
        raise ModelLoadError(f"{model_dir} has no *.safetensors weight files (only safetensors checkpoints load){hint}")
    return files


def load_weights(spec: ModelSpec, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 shard=None) -> ModelWeights:  # fmt: skip
    """The checkpoint's weights, fused for the runner. With a tensor-parallel `shard` (parallel.Shard) only that
    rank's rows and columns of each float tensor are read: the whole model is never in one rank's memory. A
    quantized projection is read whole (its codes are packed across rows or columns) and sharded once unpacked, one
    projection at a time."""
    from contextlib import ExitStack

    from safetensors import safe_open

    # Straight to the device: on CUDA the host never holds a copy of the weights.
    target = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
    with ExitStack() as files:
        slices = {}
        try:
            for path in weight_files(model_dir):
                f = files.enter_context(safe_open(str(path), framework="pt", device=target))
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    slices[name] = f.get_slice(name)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights from {model_dir}: {exc}") from exc
        if spec.quantization is None:
            _refuse_quantized({name: sl.get_dtype() for name, sl in slices.items()}, model_dir)
        return _fuse(spec, slices, model_dir, dtype, device, shard)


Ranges = list[tuple[int, int]] | None  # row (or column) ranges of a tensor to read; None: all of it


def _fuse(spec: ModelSpec, slices: dict, model_dir: Path, dtype: torch.dtype, device: torch.device,
          shard) -> ModelWeights:  # fmt: skip
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], rows: Ranges = None, cols: Ranges = None,
             out: torch.Tensor | None = None, index: tuple[slice, ...] | None = None,
             raw: bool = False, kept: bool = True) -> torch.Tensor:  # fmt: skip
        """The tensor `name` (its `rows` or `cols`, or the part `index` slices out) on the device in the model dtype
        (`raw`: in the checkpoint's own); read into `out` if given. On CPU a tensor read as it is stored is a view of
        the file's mapping, which stays mapped (and its pages resident) while one such view lives: so one that is
        `kept` as it is (an embedding, a norm) is copied, and one the layers copy anyway (a projection) is not."""
        sl = slices.get(name)
        if sl is None:
            raise ModelLoadError(f"{model_dir}: weight {name!r} is missing")
        if tuple(sl.get_shape()) != shape:
            raise ModelLoadError(f"{model_dir}: weight {name!r} has shape {tuple(sl.get_shape())}, expected {shape}")
        used.add(name)
        tensor = sl[index] if index is not None else _select(sl, rows, cols)
        if out is not None:
            return out.copy_(tensor)
        converted = tensor.to(device=device) if raw else tensor.to(device=device, dtype=dtype)
        return converted.clone() if kept and converted.data_ptr() == tensor.data_ptr() else converted

    fmt = spec.quantization

    def fetch(name: str) -> torch.Tensor | None:
        if name not in slices:
            return None
        used.add(name)
        return slices[name][:]

    def proj(module: str, shape: tuple[int, int], rows: Ranges = None, cols: Ranges = None) -> Projection:
        """A projection's weight: read by the checkpoint's format where it quantizes `module`, else as a float."""
        weight = None if fmt is None or not fmt.quantizes(module) else fmt.read(fetch, module, *shape, model_dir)
        if weight is None:
            return take(module + ".weight", shape, rows, cols, kept=False)
        if isinstance(weight, torch.Tensor):  # dequantized at load
            return _select(weight, rows, cols).to(device=device, dtype=dtype)
        if rows is not None:
            weight = cat_rows([weight[a:b] for a, b in rows], dtype)
        elif cols is not None:
            ((a, b),) = cols
            weight = weight.columns(a, b, module)
        return weight.to(device, dtype)

    def stored_float(module: str) -> bool:
        """The checkpoint holds `module` as a float `.weight` and no scale: what its producer left unquantized."""
        sl = slices.get(module + ".weight")
        return sl is not None and sl.get_dtype() in _FLOAT_DTYPES and module + ".weight_scale" not in slices

    def expert_proj(module: str, shape: tuple[int, int], rows: Ranges = None, cols: Ranges = None,
                    out: torch.Tensor | None = None) -> Projection:  # fmt: skip
        """moe_experts.Weight: an expert's (or router's) weight read as `proj` reads a projection; with `out`, read
        (dequantized if need be) into it. One stored float is read so whatever the format's ignore list says (the
        routers, which every producer leaves in float)."""
        if stored_float(module):
            return take(module + ".weight", shape, rows, cols, out=out)
        weight = proj(module, shape, rows, cols)
        if out is None:
            return weight
        return out.copy_(as_float(weight, out.dtype))

    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    # Each part's rows (q, k, v; gate, up) for this rank, and the columns of the row-parallel o and down.
    if shard is None:
        q_rows, kv_rows, inter = (0, q_out), (0, kv_out), (0, i)
    else:
        q_rows = (shard.q_heads[0] * d, shard.q_heads[1] * d)
        kv_rows, inter = (shard.kv_heads[0] * d, shard.kv_heads[1] * d), shard.inter
    bias_of_rows = shard is None or shard.keeps_biases
    fused = spec.architecture == "Phi3ForCausalLM"  # Phi-3 stores q|k|v and gate|up already fused
    layers = []
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        dense = spec.moe is None or not spec.moe.sparse[n]
        if fused:
            qkv = proj(p + "self_attn.qkv_proj", (q_out + 2 * kv_out, h), rows=[
                q_rows, _shift(kv_rows, q_out), _shift(kv_rows, q_out + kv_out)])  # fmt: skip
            gate_up = proj(p + "mlp.gate_up_proj", (2 * i, h), rows=[inter, _shift(inter, i)])
        else:
            qkv = cat_rows([proj(p + "self_attn.q_proj", (q_out, h), rows=[q_rows]),
                            proj(p + "self_attn.k_proj", (kv_out, h), rows=[kv_rows]),
                            proj(p + "self_attn.v_proj", (kv_out, h), rows=[kv_rows])], dtype)  # fmt: skip
            gate_up = cat_rows([proj(p + "mlp.gate_proj", (i, h), rows=[inter]),
                                proj(p + "mlp.up_proj", (i, h), rows=[inter])], dtype) if dense else None  # fmt: skip
        lw = LayerWeights(
            input_norm=take(p + "input_layernorm.weight", (h,)),
            qkv=qkv,
            qkv_bias=None,
            o=proj(p + "self_attn.o_proj", (h, q_out), cols=[q_rows]),
            post_norm=take(p + "post_attention_layernorm.weight", (h,)),
            gate_up=gate_up,
            down=proj(p + "mlp.down_proj", (h, i), cols=[inter]) if dense else None,
        )
        if not dense:
            lw.moe = moe_experts.read_experts(spec.moe, p, take, expert_proj, h, dtype, device, shard)
        if spec.qkv_bias:
            lw.qkv_bias = torch.cat([take(p + "self_attn.q_proj.bias", (q_out,), rows=[q_rows]),
                                     take(p + "self_attn.k_proj.bias", (kv_out,), rows=[kv_rows]),
                                     take(p + "self_attn.v_proj.bias", (kv_out,), rows=[kv_rows])])  # fmt: skip
        if spec.o_bias:
            o_bias = take(p + "self_attn.o_proj.bias", (h,))
            lw.o_bias = o_bias if bias_of_rows else None
        if spec.mlp_bias:
            lw.gate_up_bias = torch.cat([take(p + "mlp.gate_proj.bias", (i,), rows=[inter]),
                                         take(p + "mlp.up_proj.bias", (i,), rows=[inter])])  # fmt: skip
            down_bias = take(p + "mlp.down_proj.bias", (h,))
            lw.down_bias = down_bias if bias_of_rows else None
        if spec.qk_norm:
            lw.q_norm, lw.k_norm = take(p + "self_attn.q_norm.weight", (d,)), take(p + "self_attn.k_norm.weight", (d,))
        if spec.feedforward_norms:
            lw.pre_mlp_norm = take(p + "pre_feedforward_layernorm.weight", (h,))
            lw.post_mlp_norm = take(p + "post_feedforward_layernorm.weight", (h,))
        if spec.attention_sinks:  # this rank's heads' sinks, in fp32 for every kernel (bf16 ones widen exactly)
            heads = None if shard is None else [shard.q_heads]
            lw.sinks = take(p + "self_attn.sinks", (spec.num_heads,), rows=heads).float().contiguous()
        layers.append(lw)
    vocab = None if shard is None else [shard.vocab]
    embed = _pad_rows(take("model.embed_tokens.weight", (spec.vocab_size, h), rows=vocab), shard)
    if spec.tie_word_embeddings:
        lm_head = embed
        if "lm_head.weight" in slices:  # a tied checkpoint that saved the head anyway: transformers ignores it too
            used.add("lm_head.weight")
    else:
        lm_head = _pad_rows(proj("lm_head", (spec.vocab_size, h), rows=vocab), shard)
    norm = take("model.norm.weight", (h,))
    unused = sorted(n for n in slices if n not in used and not n.endswith(_IGNORABLE_SUFFIXES))
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelLoadError(f"{model_dir}: the checkpoint has tensors {spec.architecture} does not use: {shown}; "
                             "is config.json the one these weights were saved with?")  # fmt: skip
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


def _select(tensor, rows: Ranges, cols: Ranges) -> torch.Tensor:
    """`rows` (or `cols`) of a tensor or a safetensors slice, concatenated; all of it where both are None."""
    if rows is not None:
        return torch.cat([tensor[a:b] for a, b in rows])
    if cols is not None:
        return torch.cat([tensor[:, a:b] for a, b in cols], dim=1)
    return tensor[:]


def _shift(rows: tuple[int, int], by: int) -> tuple[int, int]:
    return rows[0] + by, rows[1] + by


def _pad_rows(table: Projection, shard) -> Projection:
    """A vocabulary slice padded with zero rows to the rows every rank holds (the gather needs equal shapes)."""
    if shard is None or table.shape[0] == shard.vocab_rows:
        return table
    if isinstance(table, QuantizedWeight):
        table = table.dequantize(table.dtype)
    return torch.cat([table, table.new_zeros(shard.vocab_rows - table.shape[0], table.shape[1])])


def random_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ModelWeights:
    """Random weights of the spec's shape, made on the device (no checkpoint, no host copy): for benchmarks of model
    shapes nobody needs the outputs of. Normal(0, 0.02) matrices and unit norms, as transformers initialises; no
    biases, whatever config.json says (the bias add is noise next to the matmuls a benchmark measures). Where the
    spec's format quantizes them, the decoder's projections are random codes (or FP8 values) in its layout."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    quant = spec.quantization

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)

    def projection(module: str, n: int, k: int) -> Projection:
        scheme = None if quant is None or quant.weight_scheme is None else quant.weight_scheme(module, n, k)
        if scheme is None:
            return normal(n, k)
        return random_quantized(n, k, scheme, quant.name, device, gen, dtype)

    def ones(n: int) -> torch.Tensor:  # a norm's weight that scales by 1 (Gemma's: 0, its norms scale by 1 + w)
        return torch.full((n,), 1.0 - spec.norm_weight_offset, dtype=dtype, device=device)

    sparse = spec.moe.sparse if spec.moe is not None else (False,) * spec.num_layers
    layers = [
        LayerWeights(input_norm=ones(h), qkv=projection(f"model.layers.{n}.self_attn.qkv_proj", q_out + 2 * kv_out, h),
                     qkv_bias=None, o=projection(f"model.layers.{n}.self_attn.o_proj", h, q_out), post_norm=ones(h),
                     gate_up=None if sparse[n] else projection(f"model.layers.{n}.mlp.gate_up_proj", 2 * i, h),
                     down=None if sparse[n] else projection(f"model.layers.{n}.mlp.down_proj", h, i),
                     q_norm=ones(d) if spec.qk_norm else None, k_norm=ones(d) if spec.qk_norm else None,
                     moe=moe_experts.random_experts(spec.moe, h, normal, projection if quant else None,
                                                    f"model.layers.{n}.") if sparse[n] else None,
                     pre_mlp_norm=ones(h) if spec.feedforward_norms else None,
                     post_mlp_norm=ones(h) if spec.feedforward_norms else None,
                     sinks=normal(spec.num_heads).float() if spec.attention_sinks else None)
        for n in range(spec.num_layers)
    ]  # fmt: skip
    embed = normal(spec.vocab_size, h)
    return ModelWeights(embed, layers, ones(h), embed if spec.tie_word_embeddings else normal(spec.vocab_size, h))


def _refuse_quantized(dtypes: dict[str, str], model_dir: Path) -> None:
    """`dtypes`: each tensor's safetensors dtype (F32, BF16, ...)."""
    quantized = next((n for n in dtypes if n.rsplit(".", 1)[-1] in _QUANTIZED_SUFFIXES), None)
    if quantized is not None:
        raise ModelLoadError(f"{model_dir}: tensor {quantized!r} belongs to a quantized checkpoint (AWQ/GPTQ/FP8), "
                             "but config.json has no quantization_config saying how to read it")  # fmt: skip
    odd = next(((n, t) for n, t in dtypes.items() if t not in _FLOAT_DTYPES), None)
    if odd is not None:
        kind = _TORCH_NAMES.get(odd[1], odd[1])
        raise ModelLoadError(f"{model_dir}: tensor {odd[0]!r} is torch.{kind}; only float32, bfloat16 and float16 "
                             "weights load without a quantization_config (a quantized one needs it)")  # fmt: skip
