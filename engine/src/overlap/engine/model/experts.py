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

The checkpoint holds one tensor per expert and projection, as the Hub's files do and as transformers 5's
`save_pretrained` writes them (it fuses them into 3-D `gate_up_proj` / `down_proj` parameters only in memory, and
reverts that on save). Here each sparse layer's experts are stacked at load: `gate_up` [E, 2 I, H] (each expert's
gate rows, then its up rows) and `down` [E, H, I], the router [E, H] in the model dtype.

Under tensor parallelism every rank holds every expert, each sharded along its intermediate width (its gate and up
rows, its down columns), as a dense MLP is; the router and the shared expert's gate are whole on every rank, the
shared expert is sharded like the experts. A sparse layer's output is then a partial sum like a dense MLP's: one
all-reduce per layer.

Quantized expert weights are not read yet: a quantized MoE checkpoint is refused with its format's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from overlap.engine.errors import ModelLoadError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


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

    @property
    def active_intermediate(self) -> int:
        """The intermediate width a token runs through in a sparse layer: its top-k experts and the shared one."""
        return self.top_k * self.intermediate_size + self.shared_intermediate_size


@dataclass(slots=True)
class ExpertWeights:
    """One sparse layer's weights (one rank's share of each expert's intermediate width under tensor parallelism)."""

    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2 I, H]
    down: torch.Tensor  # [E, H, I]
    shared_gate_up: torch.Tensor | None = None  # [2 S, H]
    shared_down: torch.Tensor | None = None  # [H, S]
    shared_gate: torch.Tensor | None = None  # [1, H]: sigmoid(x . w) scales the shared expert's output

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.router, self.gate_up, self.down, self.shared_gate_up, self.shared_down,
                            self.shared_gate) if t is not None]  # fmt: skip


def read_moe_spec(cfg: dict, arch: str, num_layers: int, config_path: Path, quantization=None) -> MoeSpec | None:
    """The experts of a mixture-of-experts architecture from its config.json (transformers' defaults where a field is
    absent), None for a dense one. A quantized one is refused: its expert weights would not be read."""
    if arch not in MOE_ARCHITECTURES:
        return None
    if quantization is not None:
        raise ModelLoadError(f"{config_path}: {arch} quantized as {quantization.name} is not supported: the experts of "
                             "a mixture-of-experts model load from float weights only, for now")  # fmt: skip
    try:
        if arch == "MixtralForCausalLM":
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


def read_experts(moe: MoeSpec, layer: str, take: Take, hidden: int, dtype: torch.dtype, device: torch.device,
                 shard=None) -> ExpertWeights:  # fmt: skip
    """Layer `layer`'s ("model.layers.N.") router, experts and shared expert, each expert's gate|up and down stacked;
    with a tensor-parallel `shard`, only its share of every expert's intermediate width is read."""
    h, i, p = hidden, moe.intermediate_size, f"{layer}{moe.prefix}."
    first, last = rank_range(i, shard)
    own = None if shard is None else [(first, last)]
    width = last - first
    gate, up, down_name = moe.names
    gate_up = torch.empty(moe.num_experts, 2 * width, h, dtype=dtype, device=device)
    down = torch.empty(moe.num_experts, h, width, dtype=dtype, device=device)
    for e in range(moe.num_experts):  # each straight into its place (converted there to the model dtype)
        expert = f"{p}experts.{e}."
        take(f"{expert}{gate}.weight", (i, h), rows=own, out=gate_up[e, :width])
        take(f"{expert}{up}.weight", (i, h), rows=own, out=gate_up[e, width:])
        take(f"{expert}{down_name}.weight", (h, i), cols=own, out=down[e])
    weights = ExpertWeights(router=take(p + "gate.weight", (moe.num_experts, h)), gate_up=gate_up, down=down)
    if moe.shared_intermediate_size:
        s = moe.shared_intermediate_size
        first, last = rank_range(s, shard)
        own = None if shard is None else [(first, last)]
        weights.shared_gate_up = torch.cat([take(p + "shared_expert.gate_proj.weight", (s, h), rows=own),
                                            take(p + "shared_expert.up_proj.weight", (s, h), rows=own)])  # fmt: skip
        weights.shared_down = take(p + "shared_expert.down_proj.weight", (h, s), cols=own)
        weights.shared_gate = take(p + "shared_expert_gate.weight", (1, h))
    return weights


def random_experts(moe: MoeSpec, hidden: int, normal: Callable[..., torch.Tensor]) -> ExpertWeights:
    """Random weights of one sparse layer (`moe` already one rank's share under tensor parallelism)."""
    e, h, i, s = moe.num_experts, hidden, moe.intermediate_size, moe.shared_intermediate_size
    weights = ExpertWeights(router=normal(e, h), gate_up=normal(e, 2 * i, h), down=normal(e, h, i))
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
