"""The gated MLP of the Llama family, down(silu(gate(x)) * up(x)), and Gemma's GeGLU: gelu (tanh approximation)
in place of silu."""

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

    __slots__ = ("down", "gate", "gate_up", "gelu", "inter", "silu_mul", "up")

    def __init__(self, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
                 down_bias: torch.Tensor | None, backend: LinearBackend, ops=None,
                 hidden_act: str = "silu") -> None:  # fmt: skip
        self.inter = gate_up.shape[0] // 2
        self.gelu = hidden_act == "gelu_pytorch_tanh"
        self.silu_mul = None if self.gelu else getattr(ops, "silu_mul", None)  # one kernel where the ops have it
        self.gate = self.up = self.gate_up = None
        if backend.fuses_silu and not isinstance(gate_up, QuantizedWeight) and not self.gelu:
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
            gate = gate_up[:, : self.inter]
            act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * gate_up[:, self.inter :]
        return self.down(act)
