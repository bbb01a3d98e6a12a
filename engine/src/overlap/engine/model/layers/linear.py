"""Linear projections and the kernels behind them: torch's F.linear, or on CPU (fp32, bf16) oneDNN's linear, which
takes weights prepacked once into its blocked layout and SiLU as a post-op.

In fp32 oneDNN also avoids MKL: torch's fp32 CPU matmul goes to MKL, which on AMD CPUs runs its AVX2 kernels
(docs/engine.md has the measurements). bf16 matmuls reach oneDNN anyway; prepacking saves about a fifth of a
decode-sized one. The backend is checked once against F.linear; any surprise (op missing, a build without oneDNN,
a wrong result) keeps F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows oneDNN's packed layout is chosen for; it serves any row count with identical results.
PACKED_ROWS = 32


class LinearBackend:
    """F.linear everywhere; `fuses_silu` is False and weights stay as they are."""

    name = "torch linear"
    fuses_silu = False

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def linear_silu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.silu(F.linear(x, weight, bias))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


class OneDnnBackend(LinearBackend):
    """oneDNN's linear with prepacked weights and SiLU fused into the gate matmul (CPU, fp32 and bf16)."""

    name = "oneDNN linear, weights prepacked"
    fuses_silu = True

    def __init__(self) -> None:
        self._op = torch.ops.mkldnn._linear_pointwise
        self._reorder = torch.ops.mkldnn._reorder_linear_weight

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._op(x, weight, bias, "none", [], "")

    def linear_silu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._op(x, weight, bias, "swish", [], "")

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight in oneDNN's blocked layout, reordered once instead of on every call; a weight it cannot pack
        stays plain (oneDNN's linear takes those too)."""
        try:
            return self._reorder(weight.contiguous(), PACKED_ROWS)
        except RuntimeError:
            return weight


def pick_linear_backend(device: torch.device, dtype: torch.dtype) -> LinearBackend:
    """oneDNN on CPU in fp32 and bf16 where it computes what F.linear does; F.linear otherwise."""
    plain = LinearBackend()
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return plain
    try:
        onednn = OneDnnBackend()
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 64), (24, 64), (24,)))
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        with torch.inference_mode():
            expected = F.linear(x[:, :48], w[:, :48], b).float()
            plain_out = onednn.linear(x[:, :48], w[:, :48], b).float()
            swish = onednn.linear_silu(x[:, :48], w[:, :48], b).float()  # the MLP's gate (SiLU post-op)
        if torch.allclose(plain_out, expected, atol=tolerance, rtol=tolerance) and torch.allclose(
            swish, F.silu(expected), atol=tolerance, rtol=tolerance
        ):
            return onednn
    except (AttributeError, RuntimeError):
        pass
    return plain


class Linear:
    """y = x W^T + b through the backend, W packed for it once."""

    __slots__ = ("backend", "bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: LinearBackend) -> None:
        self.backend = backend
        self.weight = backend.pack(weight)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias)
