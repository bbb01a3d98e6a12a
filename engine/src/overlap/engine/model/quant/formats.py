"""`quantization_config` as its producers write it, and each projection's tensors read into one canonical form.

- compressed-tensors (llm-compressor): `pack-quantized` W4A16 / W8A16 (`weight_packed`, `weight_scale`,
  `weight_zero_point` when asymmetric, `weight_g_idx` for act-order) and `int-quantized` W8A8 INT8 (`weight` int8,
  dynamic per-token activations) as `QuantizedWeight`; `float-quantized` FP8 (`weight` float8_e4m3fn,
  `weight_scale` per tensor, row, group or block) as a `QuantizedWeight` of FP8 codes.
- `fp8` with `weight_block_size` (DeepSeek-V3, the Qwen3 FP8 releases: `weight_scale_inv` per 128x128 block) or
  one scale per tensor: the same FP8 `QuantizedWeight`.
- GPTQ (`qweight`, `qzeros`, `scales`, `g_idx`; checkpoint_format gptq stores zero points minus one, gptq_v2 not)
  and AWQ's GEMM packing (`qweight` [in, out / 8] in AWQ's column order) as `QuantizedWeight`.
- `mxfp4` (the gpt-oss releases): only the experts are MXFP4, and experts.py dequantizes them at load; every
  projection here reads as a float weight. The loader refuses it for any other architecture.

Anything else (bitsandbytes, HQQ, EXL2, GGUF, ...) is refused by name. A reader checks every tensor's shape and
dtype against the projection's and names the tensor or field that is wrong. docs/models.md has the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from overlap.engine.config import QUANTIZATION_METHODS
from overlap.engine.errors import ModelLoadError
from overlap.engine.model.quant.weight import QuantizedWeight, WeightScheme

REFUSED_METHODS = {
    "bitsandbytes": "bitsandbytes (NF4 / LLM.int8) weights",
    "hqq": "HQQ weights",
    "exl2": "EXL2 weights",
    "exl3": "EXL3 weights",
    "gguf": "GGUF weights",
    "aqlm": "AQLM weights",
    "quanto": "optimum-quanto weights",
    "eetq": "EETQ weights",
    "torchao": "torchao weights",
    "bitnet": "BitNet weights",
    "fbgemm_fp8": "FBGEMM FP8 weights",
}
Fetch = Callable[[str], torch.Tensor | None]  # a tensor of the checkpoint by name (None: absent), marked as used


@dataclass(frozen=True, slots=True)
class IntArgs:
    """How one projection's integer weight was quantized."""

    bits: int
    group_size: int | None  # None: one scale per output row (channel), or per tensor
    symmetric: bool
    act_bits: int | None = None  # 8: dynamic per-token int8 activations (W8A8)
    per_tensor: bool = False


@dataclass(slots=True)
class QuantFormat:
    """A checkpoint's quantization: `name` for logs and the engine's info, `read` for one projection."""

    method: str  # one of QUANTIZATION_METHODS
    name: str
    ignore: list[str] = field(default_factory=list)  # modules left in float ("lm_head", "re:...")
    read_projection: Callable = None  # (fetch, module, out_features, in_features, where) -> Tensor | QuantizedWeight
    # (module, out_features, in_features) -> the WeightScheme a quantized module is stored in, else None (for random
    # weights of this format's layout)
    weight_scheme: Callable = None

    def quantizes(self, module: str) -> bool:
        return not any(_matches(pattern, module) for pattern in self.ignore)

    def read(self, fetch: Fetch, module: str, out_features: int, in_features: int, where: Path):
        """`module`'s weight [out, in]: a QuantizedWeight, or a float tensor where the format dequantizes at load."""
        return self.read_projection(fetch, module, out_features, in_features, where)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern) or module.split(".")[-1] == pattern


def parse(cfg: dict, config_path: Path, requested: str | None = None) -> QuantFormat | None:
    """The checkpoint's QuantFormat (None: float weights), checked against `--quantization` (`requested`)."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"--quantization {requested!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    if not qc:
        if requested is not None:
            raise ModelLoadError(f"--quantization {requested} was asked for, but {config_path} has no "
                                 "quantization_config: these are float weights")  # fmt: skip
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{config_path}: quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method in QUANTIZATION_METHODS and requested not in (None, method):
        raise ModelLoadError(f"--quantization {requested} was asked for, but {config_path} holds a {method} "
                             "checkpoint")  # fmt: skip
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "gptq": _gptq, "awq": _awq, "mxfp4": _mxfp4}
    if method in readers:
        try:
            return readers[method](qc, config_path)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field the checks below did not foresee
            raise ModelLoadError(f"{config_path}: malformed {method} quantization_config ({type(exc).__name__}: "
                                 f"{exc})") from None  # fmt: skip
    refused = REFUSED_METHODS.get(method.replace("-", "_")) or REFUSED_METHODS.get(method)
    what = refused or f"quant_method {method or '(none)'!r}"
    raise ModelLoadError(f"{config_path}: {what} are not supported; quantized formats that load: "
                         f"{', '.join(QUANTIZATION_METHODS)} (docs/models.md, 'Quantized checkpoints')")  # fmt: skip


def _mxfp4(qc: dict, config_path: Path) -> QuantFormat:
    """gpt-oss's MXFP4: the experts' `*_blocks` / `*_scales`, read and dequantized by experts.py; the attention, the
    router, the embedding and the LM head (modules_to_not_convert) stay float, so no projection reads through here."""
    return QuantFormat("mxfp4", "MXFP4 (experts dequantized at load)", read_projection=lambda *_: None)


# ---- shared helpers ---------------------------------------------------------------------------------------------
def _need(fetch: Fetch, name: str, where: Path) -> torch.Tensor:
    tensor = fetch(name)
    if tensor is None:
        raise ModelLoadError(f"{where}: quantized weight {name!r} is missing")
    return tensor


def _integer(fields: dict, key: str, where: str, default: int | None = None, minimum: int | None = None) -> int:
    """fields[key] (or `default` where absent), refused by name unless it is an integer (of at least `minimum`)."""
    value = fields.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{where}.{key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ModelLoadError(f"{where}.{key} must be positive, got {value}")
    return value


def _block(value, where: str) -> tuple[int, int]:
    """A block of [rows, columns] (compressed-tensors' block_structure, fp8's weight_block_size; older
    compressed-tensors wrote "RxC")."""
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):
        value = [int(v) for v in value.split("x")]
    if not isinstance(value, list | tuple) or len(value) != 2 or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value):  # fmt: skip
        raise ModelLoadError(f"{where} must be [rows, columns] of positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _check_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str, where: Path) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ModelLoadError(f"{where}: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")


def _check_dtype(tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], name: str, where: Path) -> None:
    if tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelLoadError(f"{where}: {name!r} is {str(tensor.dtype).removeprefix('torch.')}, expected {names}")


def _groups(in_features: int, group_size: int | None, name: str, where: Path) -> int:
    """The group size along the inputs (in_features for per-row), refusing one that does not divide them."""
    if group_size is None or group_size <= 0:
        return in_features
    if in_features % group_size:
        raise ModelLoadError(f"{where}: {name}: group size {group_size} does not divide its {in_features} inputs")
    return group_size


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Codes packed little-end first into int32 along the last dim (32 // bits a word) -> uint8 [..., count]."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count].to(torch.uint8)


def _act_order(codes, scale, g_idx, group, name: str, where: Path):
    """Columns sorted by their group (GPTQ act-order), so each group is a run again: (codes, perm or None)."""
    k = codes.shape[1]
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,) or bool((g_idx < 0).any()) or bool((g_idx >= scale.shape[1]).any()):
        raise ModelLoadError(f"{where}: {name}: g_idx must hold a group below {scale.shape[1]} for each of {k} inputs")
    if torch.equal(g_idx, torch.arange(k) // group):
        return codes, None
    if bool((torch.bincount(g_idx, minlength=scale.shape[1]) != group).any()):
        raise ModelLoadError(f"{where}: {name}: g_idx does not give each group {group} inputs")
    perm = torch.argsort(g_idx, stable=True)
    return codes.index_select(1, perm), perm


def _float8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, fmt: str):
    """A float8 weight and its scale (per tensor, per row [N, 1], per group [N, K/G], or per block) as FP8 codes
    with a scale per row and group of columns: a block's scale repeated over its rows. Blocks that do not tile the
    inputs (the last one cut short) have no such form: that weight is dequantized here."""
    n, k = weight.shape
    s = scale.float()
    if block is not None:
        s = s.repeat_interleave(block[0], 0)[:n]
        if k % block[1]:
            return weight.float() * s.repeat_interleave(block[1], 1)[:, :k]
    elif s.numel() == 1:
        s = s.reshape(1, 1).expand(n, 1)
    s = s.reshape(n, -1).contiguous()
    codes = weight.contiguous().view(torch.uint8)
    return QuantizedWeight(codes=codes, scale=s, zero=torch.zeros_like(s), bits=8, group_size=k // s.shape[1],
                           fmt=fmt, float8=True)  # fmt: skip


# ---- compressed-tensors (llm-compressor) ----------------------------------------------------------------------
def _ct_int_args(weights: dict, acts: dict | None, where: str) -> IntArgs:
    bits = _integer(weights, "num_bits", f"{where}.weights")
    strategy = weights.get("strategy", "tensor")
    if bits not in (4, 8):
        raise ModelLoadError(f"{where}: {bits}-bit integer weights are not supported (4 and 8 are)")
    if strategy not in ("group", "channel", "tensor"):
        raise ModelLoadError(f"{where}: integer weight strategy {strategy!r} is not supported (group, channel)")
    act_bits = None
    if acts:
        if acts.get("type", "int") != "int" or acts.get("num_bits") != 8 or not acts.get("dynamic") or \
                acts.get("strategy") != "token" or not acts.get("symmetric", True):  # fmt: skip
            raise ModelLoadError(f"{where}: input_activations {acts} are not supported with integer weights "
                                 "(dynamic symmetric int8 per token is)")  # fmt: skip
        act_bits = 8
        if bits != 8 or strategy == "group":
            raise ModelLoadError(f"{where}: int8 activations need 8-bit weights with one scale per row or tensor")
    group = _integer(weights, "group_size", f"{where}.weights", minimum=1) if strategy == "group" else None
    return IntArgs(bits, group, bool(weights.get("symmetric", True)), act_bits, strategy == "tensor")


def _compressed_tensors(qc: dict, config_path: Path) -> QuantFormat:
    fmt = qc.get("format", "dense")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{config_path}: compressed-tensors quantization_config has no config_groups")
    if qc.get("kv_cache_scheme"):
        raise ModelLoadError(f"{config_path}: a quantized KV cache (kv_cache_scheme) is not supported")
    if (qc.get("sparsity_config") or {}).get("format") not in (None, "dense"):
        raise ModelLoadError(f"{config_path}: sparse compressed-tensors checkpoints are not supported")
    schemes = []  # (targets, format, weights args dict, acts dict)
    for name, group in groups.items():
        where = f"{config_path}: config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelLoadError(f"{where} must be an object, got {type(group).__name__}")
        weights, acts = group.get("weights"), group.get("input_activations")
        group_fmt = group.get("format") or fmt
        if not weights:
            raise ModelLoadError(f"{where}: activation-only quantization is not supported")
        for part, value in (("weights", weights), ("input_activations", acts)):
            if value is not None and not isinstance(value, dict):
                raise ModelLoadError(f"{where}.{part} must be an object, got {type(value).__name__}")
        if weights.get("type") == "int":
            if group_fmt not in ("pack-quantized", "int-quantized"):
                raise ModelLoadError(f"{where}: format {group_fmt!r} is not supported for integer weights "
                                     "(pack-quantized, int-quantized)")  # fmt: skip
            args = _ct_int_args(weights, acts, where)
            if weights.get("actorder") not in (None, "group", "weight", "static", "dynamic"):
                raise ModelLoadError(f"{where}: actorder {weights.get('actorder')!r} is not supported")
        elif weights.get("type") == "float":
            if weights.get("num_bits") != 8 or group_fmt not in ("float-quantized", "naive-quantized"):
                raise ModelLoadError(f"{where}: float weights other than FP8 (float-quantized) are not supported: "
                                     f"{weights.get('num_bits')} bits, format {group_fmt!r}")  # fmt: skip
            if weights.get("strategy") not in ("tensor", "channel", "block", "group"):
                raise ModelLoadError(f"{where}: FP8 weight strategy {weights.get('strategy')!r} is not supported")
            args = dict(weights)
            if weights["strategy"] == "block":
                args["block_structure"] = _block(weights.get("block_structure") or [128, 128],
                                                 f"{where}.weights.block_structure")  # fmt: skip
            if weights["strategy"] == "group":
                _integer(weights, "group_size", f"{where}.weights", minimum=1)
        else:
            raise ModelLoadError(f"{where}: weight type {weights.get('type')!r} is not supported (int, float)")
        targets = group.get("targets") or ["Linear"]
        schemes.append((targets, group_fmt, args, acts))

    def scheme_of(module: str):
        for targets, group_fmt, args, _ in schemes:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return group_fmt, args
        return None

    def read(fetch: Fetch, module: str, out_f: int, in_f: int, where: Path):
        found = scheme_of(module)
        if found is None:  # no group targets it: a float projection
            return None
        group_fmt, args = found
        if isinstance(args, dict):
            return _ct_float(fetch, module, out_f, in_f, args, where)
        return _ct_int(fetch, module, out_f, in_f, args, group_fmt, where)

    def weight_scheme(module: str, out_f: int, in_f: int) -> WeightScheme | None:
        found = scheme_of(module)
        if found is None:
            return None
        args = found[1]
        if isinstance(args, IntArgs):
            return WeightScheme(args.bits, args.group_size or in_f, args.act_bits)
        columns = {"group": args.get("group_size"), "block": args.get("block_structure", (128, 128))[1]}
        return WeightScheme(8, int(columns.get(args.get("strategy")) or in_f), float8=True)

    described = []
    for _, group_fmt, args, acts in schemes:
        if isinstance(args, IntArgs):
            bits = f"W{args.bits}A{args.act_bits or 16}"
            layout = f"group {args.group_size}" if args.group_size else "per row"
            described.append(f"{bits} ({group_fmt}, {layout}, {'symmetric' if args.symmetric else 'asymmetric'})")
        else:
            described.append(f"FP8 W8A{8 if acts else 16} ({args.get('strategy')} scales)")
    return QuantFormat("compressed-tensors", "compressed-tensors " + ", ".join(dict.fromkeys(described)),
                       ignore=list(qc.get("ignore") or []), read_projection=read,
                       weight_scheme=weight_scheme)  # fmt: skip


def _ct_int(fetch: Fetch, module: str, out_f: int, in_f: int, args: IntArgs, group_fmt: str, where: Path):
    group = _groups(in_f, args.group_size, module, where)
    n_groups = in_f // group
    scale = _need(fetch, f"{module}.weight_scale", where)
    if args.per_tensor:
        _check_shape(scale.reshape(-1), (1,), f"{module}.weight_scale", where)
        scale = scale.reshape(1, 1).expand(out_f, 1)
    else:
        _check_shape(scale, (out_f, n_groups), f"{module}.weight_scale", where)
    mid = 2 ** (args.bits - 1)
    if group_fmt == "pack-quantized":
        packed = _need(fetch, f"{module}.weight_packed", where)
        _check_dtype(packed, (torch.int32,), f"{module}.weight_packed", where)
        _check_shape(packed, (out_f, -(-in_f * args.bits // 32)), f"{module}.weight_packed", where)
        shape = fetch(f"{module}.weight_shape")
        if shape is not None and [int(v) for v in shape.reshape(-1)] != [out_f, in_f]:
            raise ModelLoadError(f"{where}: {module}.weight_shape says {shape.tolist()}, expected {[out_f, in_f]}")
        codes = unpack_int32(packed, args.bits, in_f)  # stored with the +2**(bits-1) offset: already unsigned
        zero_name = f"{module}.weight_zero_point"
        if args.symmetric:
            zero = torch.full((out_f, n_groups), float(mid))
        else:
            packed_zero = _need(fetch, zero_name, where)
            _check_dtype(packed_zero, (torch.int32,), zero_name, where)
            _check_shape(packed_zero, (-(-out_f * args.bits // 32), n_groups), zero_name, where)
            zero = unpack_int32(packed_zero.t(), args.bits, out_f).t().float()  # packed along the rows
    else:  # int-quantized: plain int8 codes, signed
        weight = _need(fetch, f"{module}.weight", where)
        _check_dtype(weight, (torch.int8,), f"{module}.weight", where)
        _check_shape(weight, (out_f, in_f), f"{module}.weight", where)
        codes = (weight.to(torch.int16) + mid).to(torch.uint8)
        zero_name = f"{module}.weight_zero_point"
        zero_point = fetch(zero_name)
        if args.symmetric or zero_point is None:
            zero = torch.full((out_f, n_groups), float(mid))
        else:  # signed like the codes: one per group, per row or for the whole tensor
            _check_dtype(zero_point, (torch.int8, torch.int32), zero_name, where)
            if zero_point.numel() not in (1, out_f, out_f * n_groups):
                _check_shape(zero_point, (out_f, n_groups), zero_name, where)
            per = n_groups if zero_point.numel() == out_f * n_groups else 1
            zero = zero_point.reshape(-1, per).expand(out_f, n_groups).float() + mid
    perm = None
    g_idx = fetch(f"{module}.weight_g_idx")
    if g_idx is not None and group != in_f:
        codes, perm = _act_order(codes, scale, g_idx, group, module, where)
    bits_name = f"W{args.bits}A{args.act_bits or 16}"
    return QuantizedWeight(codes=codes, scale=scale.float().contiguous(), zero=zero.contiguous(), bits=args.bits,
                           group_size=group, fmt=f"compressed-tensors {bits_name}", perm=perm,
                           act_bits=args.act_bits)  # fmt: skip


def _ct_float(fetch: Fetch, module: str, out_f: int, in_f: int, weights: dict, where: Path):
    weight = _need(fetch, f"{module}.weight", where)
    _check_dtype(weight, (torch.float8_e4m3fn,), f"{module}.weight", where)
    _check_shape(weight, (out_f, in_f), f"{module}.weight", where)
    scale = _need(fetch, f"{module}.weight_scale", where)
    block = None
    strategy = weights.get("strategy")
    if strategy == "block":
        block = weights["block_structure"]  # checked at parse: (rows, columns)
        _check_shape(scale, (-(-out_f // block[0]), -(-in_f // block[1])), f"{module}.weight_scale", where)
    elif strategy == "channel":
        _check_shape(scale.reshape(-1), (out_f,), f"{module}.weight_scale", where)
    elif strategy == "group":
        group = _groups(in_f, weights["group_size"], module, where)
        _check_shape(scale, (out_f, in_f // group), f"{module}.weight_scale", where)
    else:
        _check_shape(scale.reshape(-1), (1,), f"{module}.weight_scale", where)
    fetch(f"{module}.input_scale")  # a static activation scale: the kernels quantize activations per token, if at all
    return _float8(weight, scale, block, "compressed-tensors FP8")


# ---- fp8 with block scales (DeepSeek-V3, Qwen3 FP8) -------------------------------------------------------------
def _fp8(qc: dict, config_path: Path) -> QuantFormat:
    block = qc.get("weight_block_size")
    if block is not None:
        block = _block(block, f"{config_path}: weight_block_size")
    fmt = (qc.get("fmt") or "e4m3").lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ModelLoadError(f"{config_path}: fp8 format {fmt!r} is not supported (e4m3)")

    def read(fetch: Fetch, module: str, out_f: int, in_f: int, where: Path):
        weight = _need(fetch, f"{module}.weight", where)
        _check_dtype(weight, (torch.float8_e4m3fn,), f"{module}.weight", where)
        _check_shape(weight, (out_f, in_f), f"{module}.weight", where)
        if block is not None:
            scale = _need(fetch, f"{module}.weight_scale_inv", where)
            _check_shape(scale, (-(-out_f // block[0]), -(-in_f // block[1])), f"{module}.weight_scale_inv", where)
        else:
            scale = fetch(f"{module}.weight_scale_inv")
            if scale is None:
                scale = _need(fetch, f"{module}.weight_scale", where)
            _check_shape(scale.reshape(-1), (1,), f"{module}.weight_scale", where)
        fetch(f"{module}.input_scale")
        return _float8(weight, scale, block, "fp8")

    def weight_scheme(module: str, out_f: int, in_f: int) -> WeightScheme:
        return WeightScheme(8, block[1] if block else in_f, float8=True)

    # transformers (and the releases it loads) keep the LM head in 16 bits beside the listed modules
    ignore = [*(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []), "lm_head"]
    layout = f"{block[0]}x{block[1]} block scales" if block else "per-tensor scales"
    return QuantFormat("fp8", f"fp8 ({layout})", ignore=ignore, read_projection=read, weight_scheme=weight_scheme)


# ---- GPTQ and AWQ -----------------------------------------------------------------------------------------------
def _int4_config(qc: dict, config_path: Path, method: str) -> tuple[int, int | None]:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ModelLoadError(f"{config_path}: {method} with bits={bits!r} is not supported "
                             f"({'4 and 8' if method == 'gptq' else '4'})")  # fmt: skip
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise ModelLoadError(f"{config_path}: {method} group_size must be a positive integer or -1, got {group!r}")
    return bits, None if group == -1 else group


def _packs_whole_words(module: str, sizes: tuple[int, ...], per_word: int, where: Path) -> None:
    """GPTQ and AWQ pack `per_word` codes an int32 along these sizes: a size that leaves a word part-filled has no
    layout in either format."""
    if any(size % per_word for size in sizes):
        raise ModelLoadError(f"{where}: {module}: its sizes {list(sizes)} must be multiples of {per_word}, the codes "
                             "an int32 packs")  # fmt: skip


def _unconverted(qc: dict) -> list[str]:
    """The modules GPTQ and AWQ leave in float: the LM head (unless GPTQModel's `lm_head` says otherwise) and
    `modules_to_not_convert`."""
    return list(qc.get("modules_to_not_convert") or []) + ([] if qc.get("lm_head") else ["lm_head"])


def _gptq(qc: dict, config_path: Path) -> QuantFormat:
    bits, group_size = _int4_config(qc, config_path, "gptq")
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{config_path}: GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                             "(gptq, gptq_v2)")  # fmt: skip
    zero_offset = 1 if checkpoint_format == "gptq" else 0  # v1 stores each zero point minus one
    per_word = 32 // bits
    if qc.get("dynamic"):
        raise ModelLoadError(f"{config_path}: GPTQModel's per-module overrides (dynamic) are not supported: every "
                             "module must share bits and group_size")  # fmt: skip

    def read(fetch: Fetch, module: str, out_f: int, in_f: int, where: Path) -> QuantizedWeight:
        group = _groups(in_f, group_size, module, where)
        n_groups = in_f // group
        _packs_whole_words(module, (in_f, out_f), per_word, where)
        qweight, qzeros = _need(fetch, f"{module}.qweight", where), _need(fetch, f"{module}.qzeros", where)
        scales = _need(fetch, f"{module}.scales", where)
        for name, tensor, shape in ((f"{module}.qweight", qweight, (in_f // per_word, out_f)),
                                    (f"{module}.qzeros", qzeros, (n_groups, out_f // per_word)),
                                    (f"{module}.scales", scales, (n_groups, out_f))):  # fmt: skip
            _check_shape(tensor, shape, name, where)
        codes = unpack_int32(qweight.t(), bits, in_f)  # packed along the inputs
        zero = (unpack_int32(qzeros, bits, out_f).to(torch.int32) + zero_offset).t().float()
        scale = scales.float().t().contiguous()
        g_idx = fetch(f"{module}.g_idx")
        perm = None
        if g_idx is not None and group != in_f:
            codes, perm = _act_order(codes, scale, g_idx, group, module, where)
        return QuantizedWeight(codes=codes.contiguous(), scale=scale, zero=zero.contiguous(), bits=bits,
                               group_size=group, fmt="gptq", perm=perm)  # fmt: skip

    order = "act-order" if qc.get("desc_act") else "in order"
    layout = f"group {group_size}" if group_size else "per row"
    symmetry = "symmetric" if qc.get("sym", True) else "asymmetric"
    return QuantFormat("gptq", f"gptq W{bits}A16 ({layout}, {order}, {symmetry})",
                       ignore=_unconverted(qc), read_projection=read)  # fmt: skip


# AutoAWQ's GEMM kernels pack the 8 columns of a word in this order: column 8j + AWQ_ORDER[i] sits in nibble i.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq(qc: dict, config_path: Path) -> QuantFormat:
    _, group_size = _int4_config(qc, config_path, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{config_path}: AWQ version {version!r} is not supported (gemm)")
    if not qc.get("zero_point", True):
        raise ModelLoadError(f"{config_path}: AWQ without zero points is not supported")
    undo = torch.tensor(AWQ_ORDER).argsort()  # nibble of each column within its word

    def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
        nibbles = unpack_int32(packed, 4, packed.shape[1] * 8).view(packed.shape[0], -1, 8)
        return nibbles[:, :, undo].reshape(packed.shape[0], -1)[:, :cols]

    def read(fetch: Fetch, module: str, out_f: int, in_f: int, where: Path) -> QuantizedWeight:
        group = _groups(in_f, group_size, module, where)
        n_groups = in_f // group
        _packs_whole_words(module, (out_f,), 8, where)
        qweight, qzeros = _need(fetch, f"{module}.qweight", where), _need(fetch, f"{module}.qzeros", where)
        scales = _need(fetch, f"{module}.scales", where)
        for name, tensor, shape in ((f"{module}.qweight", qweight, (in_f, out_f // 8)),
                                    (f"{module}.qzeros", qzeros, (n_groups, out_f // 8)),
                                    (f"{module}.scales", scales, (n_groups, out_f))):  # fmt: skip
            _check_shape(tensor, shape, name, where)
        codes = unpack(qweight, out_f).t().contiguous()  # [K, N] -> [N, K]
        zero = unpack(qzeros, out_f).t().float().contiguous()
        return QuantizedWeight(codes=codes, scale=scales.float().t().contiguous(), zero=zero, bits=4,
                               group_size=group, fmt="awq")  # fmt: skip

    layout = f"group {group_size}" if group_size else "per row"
    return QuantFormat("awq", f"awq W4A16 ({layout}, GEMM packing)", ignore=_unconverted(qc),
                       read_projection=read)  # fmt: skip
