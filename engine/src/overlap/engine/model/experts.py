"""Mixture-of-experts checkpoints: the config.json fields that shape the experts, and each sparse layer's weights read
into one packed layout (layers/moe.py computes them).

Families, as transformers 5 computes them:

- `Qwen3MoeForCausalLM`: router softmax in fp32, top-k, renormalised when `norm_topk_prob`, the weights cast to the
  model dtype; experts `mlp.experts.E.{gate,up,down}_proj`; dense MLP layers where `mlp_only_layers` or
  `decoder_sparse_step` say.
- `Qwen2MoeForCausalLM`: the same, plus a shared expert (`mlp.shared_expert.*`) every token runs through, its output
  scaled by sigmoid(`mlp.shared_expert_gate`).
- `MixtralForCausalLM`: softmax in fp32, top-k, always renormalised (the softmax over the top-k logits), the weights
  kept in fp32; experts `block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down); every layer sparse.
- `GptOssForCausalLM`: a biased router (`mlp.router.weight`, `.bias`); top-k of its logits first, then a softmax over
  those k in the model dtype; experts with biases on gate|up and down and the clamped SwiGLU: gate clamped to at most
  `swiglu_limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(`swiglu_alpha` * gate); every layer sparse.

Qwen and Mixtral checkpoints hold one tensor per expert and projection, as the Hub's files do and as transformers 5's
`save_pretrained` writes them (it fuses them into 3-D `gate_up_proj` / `down_proj` parameters only in memory, and
reverts that on save). gpt-oss's hold each layer's experts fused, as its parameters are: `mlp.experts.gate_up_proj`
[E, H, 2 I] (input-major, each expert's gate and up columns interleaved: gate at the even ones, up at the odd ones),
`gate_up_proj_bias` [E, 2 I] interleaved alike, `down_proj` [E, I, H], `down_proj_bias` [E, H]; or, in the released
checkpoints (quant_method mxfp4), gate|up and down as MXFP4 `*_blocks` / `*_scales` (`dequantize_mxfp4`), dequantized
here at load on whatever device the weights load to. Either way each sparse layer's experts are stacked at load into
one layout: `gate_up` [E, 2 I, H] (each expert's gate rows, then its up rows; biases [E, 2 I] alike) and `down`
[E, H, I], the router [E, H] in the model dtype; the expert path (layers/moe.py) never sees the checkpoint's format.

Under tensor parallelism every rank holds every expert, each sharded along its intermediate width (its gate and up
rows, its down columns), as a dense MLP is; the router and the shared expert's gate are whole on every rank, the
shared expert is sharded like the experts. A sparse layer's output is then a partial sum like a dense MLP's: one
all-reduce per layer.

Quantized experts (Qwen and Mixtral, in any format quant/formats.py reads: compressed-tensors, block FP8, GPTQ, AWQ)
are read as the dense layers' projections are (`Projection`): on the CPU, where the format keeps a weight quantized (4
and 8 bits), `gate_up` and `down` are lists of one quantized weight per expert, each expert then a gated MLP through
the format's kernels; where it dequantizes at load (FP8 on a CPU), and on CUDA (whose fused kernels take float
experts), they are stacked as above, each expert dequantized into its place as it is read. The routers stay float,
as every producer leaves them. A quantized gpt-oss other than MXFP4 is refused with its format's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from overlap.engine.errors import ModelLoadError
from overlap.engine.model.quant.weight import QuantizedWeight, as_float, cat_rows

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
# e2m1: the 16 values of an MXFP4 code, sign in the high bit (transformers' integrations/mxfp4.py FP4_VALUES)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """What the sparse layers of a mixture-of-experts model compute; `sparse[n]` says whether layer n is one (else
    it is a dense MLP of the spec's intermediate_size)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top-k probabilities renormalised to sum to 1
    weights_fp32: bool  # routing weights applied in fp32 (Mixtral) rather than cast to the model dtype (Qwen)
    shared_intermediate_size: int  # the shared expert's (0: none)
    sparse: tuple[bool, ...]
    prefix: str  # the sparse block's module under the layer: "mlp" or "block_sparse_moe"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up and down
    # gpt-oss (the defaults are the other families'):
    topk_first: bool = False  # top-k of the router's logits, then a softmax over those k (else softmax, then top-k)
    biases: bool = False  # the router, each expert's gate|up and down have biases
    fused: bool = False  # the checkpoint holds each layer's experts fused, gate and up interleaved (see above)
    activation: str = "silu"  # "silu": silu(gate) * up; "clamped_swiglu": gpt-oss's, with `swiglu`
    swiglu: tuple[float, float] = (1.702, 7.0)  # (alpha, limit) of the clamped SwiGLU
    mxfp4: bool = False  # the fused experts' gate|up and down are stored as MXFP4 blocks and scales

    @property
    def active_intermediate(self) -> int:
        """The intermediate width a token runs through in a sparse layer: its top-k experts and the shared one."""
        return self.top_k * self.intermediate_size + self.shared_intermediate_size


@dataclass(slots=True)
class ExpertWeights:
    """One sparse layer's weights (one rank's share of each expert's intermediate width under tensor parallelism)."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor | list  # [E, 2 I, H]; or per expert its [2 I, H] kept quantized (a QuantizedWeight)
    down: torch.Tensor | list  # [E, H, I]; or per expert its [H, I] alike
    shared_gate_up: torch.Tensor | QuantizedWeight | None = None  # [2 S, H]
    shared_down: torch.Tensor | QuantizedWeight | None = None  # [H, S]
    shared_gate: torch.Tensor | None = None  # [1, H]: sigmoid(x . w) scales the shared expert's output
    router_bias: torch.Tensor | None = None  # [E] (gpt-oss)
    gate_up_bias: torch.Tensor | None = None  # [E, 2 I], gate then up like gate_up's rows
    down_bias: torch.Tensor | None = None  # [E, H]; under tensor parallelism only on rank 0 (added once)

    def experts(self) -> list[torch.Tensor | QuantizedWeight]:
        """The routed experts' weights (their gate|up and down; not the shared expert's)."""
        return [*self.gate_up, *self.down] if isinstance(self.gate_up, list) else [self.gate_up, self.down]

    def tensors(self) -> list[torch.Tensor | QuantizedWeight]:
        return [t for t in (self.router, *self.experts(), self.shared_gate_up, self.shared_down, self.shared_gate,
                            self.router_bias, self.gate_up_bias, self.down_bias)
                if t is not None]  # fmt: skip

    def stacked(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [E, 2 I, H] and down [E, H, I] as float tensors (quantized experts dequantized)."""
        if not isinstance(self.gate_up, list):
            return self.gate_up, self.down
        return tuple(torch.stack([as_float(w, dtype) for w in ws]) for ws in (self.gate_up, self.down))


def read_moe_spec(cfg: dict, arch: str, num_layers: int, config_path: Path, quantization=None) -> MoeSpec | None:
    """The experts of a mixture-of-experts architecture from its config.json (transformers' defaults where a field is
    absent), None for a dense one. gpt-oss quantized other than as MXFP4 is refused: its fused experts would not be
    read."""
    if arch not in MOE_ARCHITECTURES:
        return None
    if arch == "GptOssForCausalLM" and quantization is not None and quantization.method != "mxfp4":
        raise ModelLoadError(f"{config_path}: {arch} quantized as {quantization.name} is not supported: gpt-oss's "
                             "experts load from float weights or MXFP4")  # fmt: skip
    try:
        if arch == "GptOssForCausalLM":
            experts, top_k = _num_experts(cfg, 128), int(cfg.get("num_experts_per_tok", 4))
            swiglu = (float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
            spec = MoeSpec(experts, top_k, int(cfg["intermediate_size"]), norm_topk_prob=False, weights_fp32=False,
                           shared_intermediate_size=0, sparse=(True,) * num_layers, prefix="mlp", topk_first=True,
                           biases=True, fused=True, activation="clamped_swiglu", swiglu=swiglu,
                           mxfp4=quantization is not None)  # fmt: skip
        elif arch == "MixtralForCausalLM":
            experts, top_k = _num_experts(cfg, 8), int(cfg.get("num_experts_per_tok", 2))
            spec = MoeSpec(experts, top_k, int(cfg["intermediate_size"]), norm_topk_prob=True, weights_fp32=True,
                           shared_intermediate_size=0, sparse=(True,) * num_layers, prefix="block_sparse_moe",
                           names=("w1", "w3", "w2"))  # fmt: skip
        else:
            qwen2 = arch == "Qwen2MoeForCausalLM"
            experts = _num_experts(cfg, 60 if qwen2 else 128)
            top_k = int(cfg.get("num_experts_per_tok", 4 if qwen2 else 8))
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = {int(n) for n in cfg.get("mlp_only_layers") or []}
            sparse = tuple(n not in dense and experts > 0 and (n + 1) % step == 0 for n in range(num_layers))
            spec = MoeSpec(experts, top_k, int(cfg.get("moe_intermediate_size", 1408 if qwen2 else 768)),
                           norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), weights_fp32=False,
                           shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 5632)) if qwen2
                           else 0, sparse=sparse, prefix="mlp")  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: a mixture-of-experts field is mangled: {exc!r}") from exc
    if any(spec.sparse) and not 0 < spec.top_k <= spec.num_experts:
        raise ModelLoadError(f"{config_path}: num_experts_per_tok {spec.top_k} must be between 1 and the "
                             f"{spec.num_experts} experts")  # fmt: skip
    return spec


def _num_experts(cfg: dict, default: int) -> int:
    """The expert count under either name: the Hub's configs write num_experts (Qwen) or num_local_experts
    (Mixtral); transformers 5 maps one to the other and saves Qwen3-MoE's as num_local_experts."""
    value = cfg.get("num_experts", cfg.get("num_local_experts"))
    return default if value is None else int(value)


def rank_range(total: int, shard) -> tuple[int, int]:
    """[first, last) of a width of `total` that the tensor-parallel `shard` holds (all of it on one device)."""
    if shard is None:
        return 0, total
    return shard.rank * total // shard.size, (shard.rank + 1) * total // shard.size


# take(name, shape, rows=None, cols=None, out=None): a checkpoint tensor (read into `out`), marked as used
Take = Callable[..., torch.Tensor]
# weight(module, shape, rows=None, cols=None, out=None): a module's weight as the dense layers' projections are read
# (a QuantizedWeight where the format keeps it quantized, else a float tensor in the model dtype, read into `out`)
Weight = Callable[..., torch.Tensor | QuantizedWeight]


def read_experts(moe: MoeSpec, layer: str, take: Take, weight: Weight, hidden: int, dtype: torch.dtype,
                 device: torch.device, shard=None) -> ExpertWeights:  # fmt: skip
    """Layer `layer`'s ("model.layers.N.") router, experts and shared expert, each expert's gate|up and down stacked;
    with a tensor-parallel `shard`, only its share of every expert's intermediate width is kept. gpt-oss's fused
    experts are read with `take`, the others' modules with `weight`."""
    if moe.fused:
        return _read_fused(moe, layer, take, hidden, dtype, shard)
    h, i, p = hidden, moe.intermediate_size, f"{layer}{moe.prefix}."
    first, last = rank_range(i, shard)
    own = None if shard is None else [(first, last)]
    width = last - first
    gate, up, down_name = moe.names
    first_gate = weight(f"{p}experts.0.{gate}", (i, h), rows=own)
    # kept quantized on the CPU paths (one gated MLP per expert through the format's kernel); on CUDA the fused
    # kernels take float experts, so they are dequantized here, one at a time, before the KV pool is sized
    if isinstance(first_gate, QuantizedWeight) and device.type == "cpu":
        gate_up, down = [], []
        for e in range(moe.num_experts):
            expert = f"{p}experts.{e}."
            gates = first_gate if e == 0 else weight(f"{expert}{gate}", (i, h), rows=own)
            gate_up.append(cat_rows([gates, weight(f"{expert}{up}", (i, h), rows=own)], dtype))
            down.append(weight(f"{expert}{down_name}", (h, i), cols=own))
    else:
        gate_up = torch.empty(moe.num_experts, 2 * width, h, dtype=dtype, device=device)
        down = torch.empty(moe.num_experts, h, width, dtype=dtype, device=device)
        gate_up[0, :width] = as_float(first_gate, dtype)
        for e in range(moe.num_experts):  # each straight into its place (converted there to the model dtype)
            expert = f"{p}experts.{e}."
            if e:
                weight(f"{expert}{gate}", (i, h), rows=own, out=gate_up[e, :width])
            weight(f"{expert}{up}", (i, h), rows=own, out=gate_up[e, width:])
            weight(f"{expert}{down_name}", (h, i), cols=own, out=down[e])
    # the router and the shared expert's gate are applied with F.linear: float whatever the format
    weights = ExpertWeights(router=as_float(weight(p + "gate", (moe.num_experts, h)), dtype), gate_up=gate_up,
                            down=down)  # fmt: skip
    if moe.shared_intermediate_size:
        s = moe.shared_intermediate_size
        first, last = rank_range(s, shard)
        own = None if shard is None else [(first, last)]
        weights.shared_gate_up = cat_rows([weight(p + "shared_expert.gate_proj", (s, h), rows=own),
                                           weight(p + "shared_expert.up_proj", (s, h), rows=own)], dtype)  # fmt: skip
        weights.shared_down = weight(p + "shared_expert.down_proj", (h, s), cols=own)
        weights.shared_gate = as_float(weight(p + "shared_expert_gate", (1, h)), dtype)
    return weights


def _read_fused(moe: MoeSpec, layer: str, take: Take, h: int, dtype: torch.dtype, shard) -> ExpertWeights:
    """gpt-oss's fused experts (float or MXFP4) into the stacked layout: gate and up de-interleaved into gate rows
    then up rows, each made [out, in]. A rank reads its own columns of gate|up (interleaved: 2 first .. 2 last) and
    rows of down (first .. last); only rank 0 keeps the down biases, which the all-reduce would add size times."""
    e, i, p = moe.num_experts, moe.intermediate_size, f"{layer}{moe.prefix}."
    first, last = rank_range(i, shard)
    x, every, own = p + "experts.", slice(None), slice(2 * first, 2 * last)
    if moe.mxfp4:  # blocks [E, out, in / 32, 16], scales [E, out, in / 32]: out-major already
        if h % MXFP4_BLOCK or i % MXFP4_BLOCK:
            raise ModelLoadError(f"MXFP4 experts need hidden ({h}) and intermediate ({i}) sizes that are multiples of "
                                 f"{MXFP4_BLOCK}")  # fmt: skip
        g_h, g_i = h // MXFP4_BLOCK, i // MXFP4_BLOCK
        # [E, 2 w, H], gate and up rows interleaved
        gate_up = dequantize_mxfp4(take(x + "gate_up_proj_blocks", (e, 2 * i, g_h, 16), index=(every, own), raw=True),
                                   take(x + "gate_up_proj_scales", (e, 2 * i, g_h), index=(every, own), raw=True),
                                   dtype, x + "gate_up_proj")  # fmt: skip
        g0, g1 = first // MXFP4_BLOCK, -(-last // MXFP4_BLOCK)  # the blocks holding this rank's columns
        blocks = (every, every, slice(g0, g1))
        down = dequantize_mxfp4(take(x + "down_proj_blocks", (e, h, g_i, 16), index=blocks, raw=True),
                                take(x + "down_proj_scales", (e, h, g_i), index=blocks, raw=True),
                                dtype, x + "down_proj")  # fmt: skip
        down = down[:, :, first - g0 * MXFP4_BLOCK : last - g0 * MXFP4_BLOCK]
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:  # gate_up_proj [E, H, 2 I] and down_proj [E, I, H]: input-major
        gate_up = take(x + "gate_up_proj", (e, h, 2 * i), index=(every, every, own))
        gate, up = gate_up[..., 0::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2)
        down = take(x + "down_proj", (e, i, h), index=(every, slice(first, last))).transpose(1, 2)
    gate_up_bias = take(x + "gate_up_proj_bias", (e, 2 * i), index=(every, own))
    down_bias = take(x + "down_proj_bias", (e, h))
    return ExpertWeights(
        router=take(p + "router.weight", (e, h)),
        gate_up=torch.cat([gate, up], dim=1).contiguous(),
        down=down.contiguous(),
        router_bias=take(p + "router.bias", (e,)),
        gate_up_bias=torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1).contiguous(),
        down_bias=down_bias if shard is None or shard.keeps_biases else None,
    )


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """MXFP4 as the gpt-oss checkpoints store it (transformers' integrations/mxfp4.py, convert_moe_packed_tensors):
    blocks uint8 [..., G, 16] hold 32 e2m1 codes each, value 2j in the low nibble and 2j + 1 in the high one; scales
    uint8 [..., G] the power of two shared by a block's 32, biased by 127. -> [..., G * 32] in `dtype` (exact in fp32
    and bf16: a code has two significant bits), computed one expert (leading index) at a time."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(f"MXFP4 {name}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ModelLoadError(f"MXFP4 {name}: blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], MXFP4_BLOCK, dtype=dtype, device=blocks.device)
    for e in range(blocks.shape[0]):
        codes, values = blocks[e], out[e]
        values[..., 0::2] = lut[(codes & 0x0F).int()]
        values[..., 1::2] = lut[(codes >> 4).int()]
        torch.ldexp(values, scales[e].int().sub_(127).unsqueeze(-1), out=values)
    return out.flatten(-2)


def random_experts(moe: MoeSpec, hidden: int, normal: Callable[..., torch.Tensor],
                   projection: Callable[..., torch.Tensor | QuantizedWeight] | None = None,
                   layer: str = "") -> ExpertWeights:  # fmt: skip
    """Random weights of one sparse layer (`moe` already one rank's share under tensor parallelism). Where
    `projection(module, n, k)` (loader.random_weights') makes quantized weights, each expert's are made by it, as
    read_experts keeps a quantized checkpoint's."""
    e, h, i, s = moe.num_experts, hidden, moe.intermediate_size, moe.shared_intermediate_size
    p = f"{layer}{moe.prefix}."
    first = None if projection is None or moe.fused else projection(f"{p}experts.0.gate_up_proj", 2 * i, h)
    if isinstance(first, QuantizedWeight):
        gate_up = [first, *(projection(f"{p}experts.{n}.gate_up_proj", 2 * i, h) for n in range(1, e))]
        down = [projection(f"{p}experts.{n}.down_proj", h, i) for n in range(e)]
    else:
        gate_up, down = normal(e, 2 * i, h), normal(e, h, i)
    weights = ExpertWeights(router=normal(e, h), gate_up=gate_up, down=down)
    if s:
        weights.shared_gate_up, weights.shared_down, weights.shared_gate = normal(2 * s, h), normal(h, s), normal(1, h)
    return weights


def shard_moe(moe: MoeSpec, shard) -> MoeSpec:
    """The spec as one rank's layers see it: its share of each expert's (and the shared expert's) width."""
    first, last = rank_range(moe.intermediate_size, shard)
    shared_first, shared_last = rank_range(moe.shared_intermediate_size, shard)
    return replace(moe, intermediate_size=last - first, shared_intermediate_size=shared_last - shared_first)


def check_divides(moe: MoeSpec, size: int) -> None:
    """ModelLoadError where `size` ranks cannot split each expert's (or the shared expert's) intermediate width."""
    widths = {"each expert's": moe.intermediate_size, "the shared expert's": moe.shared_intermediate_size}
    for what, width in widths.items():
        if width % size:
            raise ModelLoadError(f"tensor_parallel_size {size} does not divide {what} intermediate size {width}")
