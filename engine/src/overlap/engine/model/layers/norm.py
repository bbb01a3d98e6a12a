"""RMSNorm: one native call on CPU (fp32, bf16; torch takes ~8 kernels and two fp32 round trips), one Triton kernel
next to the Triton attention (`triton_ops.py`), F.rms_norm elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from overlap.engine.model.native import CpuOps

if TYPE_CHECKING:
    from overlap.engine.model.triton_ops import TritonOps


class RMSNorm:
    __slots__ = ("eps", "ops", "shape", "weight")

    def __init__(self, weight: torch.Tensor, eps: float, ops: CpuOps | TritonOps | None) -> None:
        self.weight = weight
        self.eps = eps
        self.shape = (weight.shape[0],)
        self.ops = ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)
