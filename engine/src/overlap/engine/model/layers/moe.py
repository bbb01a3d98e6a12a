"""A sparse mixture-of-experts block: the router picks each token's top-k experts, each active expert runs its gated
MLP over the tokens routed to it, and their outputs come back weighted and summed per token.

Routing is transformers' to the op: router logits in the model dtype (F.linear, as transformers computes them), a
softmax in fp32, `torch.topk` (so ties between experts break as transformers breaks them), the top-k renormalised
where the family does (Mixtral always, Qwen with `norm_topk_prob`), the weights cast to the model dtype (Qwen) or
kept in fp32 (Mixtral), each expert's output multiplied by its weight and the k of a token summed in top-k order.
gpt-oss's router has a bias and takes the top-k of the logits first, then a softmax over those k in the logits' dtype;
its experts add biases to gate|up and down and apply the clamped SwiGLU (layers/mlp.py).

The experts (model/experts.py: gate|up [E, 2 I, H], down [E, H, I]):

- On the CPU paths each expert is a `GatedMLP` of its own, so its weights are packed once for oneDNN: a step sorts
  its (token, expert) pairs by expert, gathers each active expert's rows and runs that expert once over them, so
  every active expert's weights stream once per step and an inactive one's not at all (a one-token decode step
  touches top-k experts a layer). Where no expert has more rows than the native kernel takes, one call of it runs
  every active expert (`native`): one parallel region a layer instead of three kernel calls an expert
  (`OVERLAP_NATIVE_EXPERTS=0`: expert by expert, to compare against).
- On CUDA with Triton, one fused kernel pair over the sorted pairs (model/triton_moe.py), with no host sync, so
  decode steps can be captured in CUDA graphs. Elsewhere (the device-generic paths on the CPU) the grouped torch path
  above, over F.linear; tests run the kernels on the CPU in Triton's interpreter by setting `FUSED_ON_CPU`.

Under tensor parallelism each rank's experts hold a share of their intermediate width: the block's output is a
partial sum that the decoder all-reduces with the attention's, as a dense MLP's (down biases, weighted, on rank 0
only). Qwen2-MoE's shared expert runs over
every token, scaled by sigmoid(x . shared_gate) (a whole vector on every rank: the scale distributes over the sum).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from overlap.engine.model.experts import ExpertWeights, MoeSpec
from overlap.engine.model.layers.linear import LinearBackend
from overlap.engine.model.layers.mlp import GatedMLP

# The Triton kernels on the CPU too, where the step runs Triton (tests: in Triton's interpreter, about 10 ms a program)
FUSED_ON_CPU = False


def route(logits: torch.Tensor, top_k: int, renormalise: bool, weights_fp32: bool,
          topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each row's top-k experts [T, k] and their weights [T, k] from the router's logits [T, E], as transformers'
    TopKRouter computes them (fp32 weights for Mixtral, the logits' dtype for Qwen); `topk_first` (gpt-oss): the
    top-k logits, then their softmax in the logits' dtype."""
    if topk_first:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        top /= top.sum(dim=-1, keepdim=True)
    return (top if weights_fp32 else top.to(logits.dtype)), ids


class SparseMoE:
    """The sparse block of one layer (the `mlp` of its decoder layer)."""

    def __init__(self, weights: ExpertWeights, moe: MoeSpec, backend: LinearBackend, ops=None) -> None:
        self.top_k, self.renormalise, self.weights_fp32 = moe.top_k, moe.norm_topk_prob, moe.weights_fp32
        self.topk_first = moe.topk_first
        self.num_experts = len(weights.gate_up)
        self.router, self.router_bias = weights.router, weights.router_bias
        self.fused = None  # the Triton kernels (device paths with Triton), else one GatedMLP per expert
        self.native = None  # (kernel, gate, up, down addresses) for steps the kernel takes in one call
        self.experts: list[GatedMLP] = []
        swiglu = moe.swiglu if moe.activation == "clamped_swiglu" else None
        gate_up_bias, down_bias = weights.gate_up_bias, weights.down_bias
        # quantized_triton: set where the step runs Triton kernels (the device paths with the Triton attention)
        if backend.quantized_triton and (weights.router.is_cuda or FUSED_ON_CPU):
            from overlap.engine.model.triton_moe import FusedMoE

            # float experts only (no quantized fused-MoE kernel yet): on CUDA read_experts dequantized them at load;
            # a CPU run in Triton's interpreter (tests) stacks the quantized ones here
            self.fused = FusedMoE(*weights.stacked(weights.router.dtype), gate_up_bias, down_bias, swiglu)
            weights.gate_up = weights.down = None  # the kernels hold their own (a quantized list's stack)
        else:
            # torch's SiLU-mul: the ops' Triton one (the device paths on a CPU, in the interpreter) per active expert
            # would cost more than the step's attention
            self.experts = [GatedMLP(weights.gate_up[e], None if gate_up_bias is None else gate_up_bias[e],
                                     weights.down[e], None if down_bias is None else down_bias[e], backend,
                                     hidden_act=moe.activation, swiglu=swiglu)
                            for e in range(self.num_experts)]  # fmt: skip
            self.native = self._native_experts(backend)
            if backend.fuses_silu:
                # oneDNN packed a copy of every expert: the stacked tensors go now, not once the whole model is built,
                # so that loading holds the experts once (a layer's twice), not twice over
                weights.gate_up = weights.down = None
        self.shared = None
        if weights.shared_gate_up is not None:
            self.shared = GatedMLP(weights.shared_gate_up, None, weights.shared_down, None, backend, ops)
        self.shared_gate = weights.shared_gate
        self.expert_runs = 0  # experts run so far, summed over steps (the grouped path; benchmarks read it)

    def _native_experts(self, backend: LinearBackend):
        """The native kernel's one-call path over every expert, where each expert's gate, up and down go through it
        (oneDNN's packed layout on this CPU, no biases, SiLU), else None."""
        if os.environ.get("OVERLAP_NATIVE_EXPERTS", "1") == "0":  # expert by expert, to compare against
            return None
        kernel = getattr(backend, "rows_kernel", None)
        mlps = self.experts
        if kernel is None or any(mlp.gate is None or mlp.gelu or mlp.swiglu is not None for mlp in mlps):
            return None
        layers = [(mlp.gate, mlp.up, mlp.down) for mlp in mlps]
        if any(linear.rows is None or linear.bias is not None for three in layers for linear in three):
            return None
        addresses = [torch.tensor([three[i].rows[1] for three in layers], dtype=torch.int64) for i in range(3)]
        return (kernel, *addresses)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each row of x."""
        logits = F.linear(x, self.router, self.router_bias)
        return route(logits, self.top_k, self.renormalise, self.weights_fp32, self.topk_first)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.fused(x, weights, ids) if self.fused is not None else self.grouped(x, weights, ids)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H]: the (token, expert) pairs sorted by expert, each active expert
        once over its rows."""
        rows, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair indices (token * k + slot), grouped by expert
        tokens = order // k
        counted = torch.bincount(flat, minlength=self.num_experts)
        counts = counted.tolist()
        self.expert_runs += sum(1 for count in counts if count)
        gathered = x.index_select(0, tokens)
        if self.native is not None and max(counts) <= self.native[0].MAX_ROWS:  # decode-sized: every expert at once
            kernel, gate, up, down = self.native
            out = kernel.experts(gathered, counted, gate, up, down, self.experts[0].inter)
        else:
            out = torch.empty_like(gathered)
            start = 0
            for expert, count in enumerate(counts):
                if count:
                    out[start : start + count] = self.experts[expert](gathered[start : start + count])
                    start += count
        # Weighted in transformers' dtype (fp32 for Mixtral), put back in (token, slot) order, summed over the slots.
        weighted = out * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        pairs = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return pairs.view(rows, k, x.shape[1]).sum(dim=1).to(x.dtype)
