"""The gated MLP of the Llama family, down(silu(gate(x)) * up(x)), Gemma's GeGLU: gelu (tanh approximation) in place
of silu, and gpt-oss's clamped SwiGLU (its experts): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), where
g = min(gate, limit), as transformers' GptOssExperts computes it, op by op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overlap.engine.model.layers.linear import Linear, LinearBackend
from overlap.engine.model.quant.weight import QuantizedWeight


class GatedMLP:
    """gate and up as one matmul (its output split), or, where the backend fuses SiLU into a matmul (oneDNN), as two:
    SiLU rides on the gate's matmul, no separate pass over its output. A quantized gate|up stays one matmul: its
    kernel prepares (and, W8A8, quantizes) the activations once for both. GeGLU (`hidden_act` gelu_pytorch_tanh)
    is always one gate|up matmul, its activation a torch op."""

    __slots__ = ("down", "gate", "gate_up", "gelu", "inter", "silu_mul", "swiglu", "up")

    def __init__(self, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
                 down_bias: torch.Tensor | None, backend: LinearBackend, ops=None, hidden_act: str = "silu",
                 swiglu: tuple[float, float] | None = None) -> None:  # fmt: skip
        """`hidden_act` "clamped_swiglu" (gpt-oss's experts) takes `swiglu` = (alpha, limit)."""
        self.inter = gate_up.shape[0] // 2
        self.gelu = hidden_act == "gelu_pytorch_tanh"
        self.swiglu = swiglu if hidden_act == "clamped_swiglu" else None
        silu = not self.gelu and self.swiglu is None
        self.silu_mul = getattr(ops, "silu_mul", None) if silu else None  # one kernel where the ops have it
        self.gate = self.up = self.gate_up = None
        if backend.fuses_silu and not isinstance(gate_up, QuantizedWeight) and silu:
            halves = [None, None] if gate_up_bias is None else gate_up_bias.split(self.inter)
            self.gate = Linear(gate_up[: self.inter], halves[0], backend)
            self.up = Linear(gate_up[self.inter :], halves[1], backend)
        else:
            self.gate_up = Linear(gate_up, gate_up_bias, backend)
        self.down = Linear(down, down_bias, backend)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            act = self.gate.silu(x).mul_(self.up(x))
        else:
            gate_up = self.gate_up(x)
            if self.silu_mul is not None:
                return self.down(self.silu_mul(gate_up))
            gate, up = gate_up[:, : self.inter], gate_up[:, self.inter :]
            if self.swiglu is not None:
                alpha, limit = self.swiglu
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
                act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
            else:
                act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return self.down(act)
