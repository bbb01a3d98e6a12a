"""Linear projections and the kernels behind them: torch's F.linear, or on CPU (fp32, bf16) oneDNN's linear, which
takes weights prepacked once into its blocked layout and SiLU as a post-op.

In fp32 oneDNN also avoids MKL: torch's fp32 CPU matmul goes to MKL, which on AMD CPUs runs its AVX2 kernels
(docs/engine.md has the measurements). bf16 matmuls reach oneDNN anyway; prepacking saves about a fifth of a
decode-sized one. The backend is checked once against F.linear; any surprise (op missing, a build without oneDNN,
a wrong result) keeps F.linear.

On a CPU with AVX-512, decode-sized steps (up to 64 rows in bf16, 48 in fp32) go to the native kernel in
`linear_packed.c`, which reads the same packed weights: it streams them closer to the memory bandwidth than oneDNN
does at those sizes. It is used only where the packed layout on this CPU is the one it reads and its results match
oneDNN's (checked once, and one row per weight), and in bf16 only without AMX: there oneDNN's AMX kernels keep every
size. `OVERLAP_NATIVE_LINEAR=0` (or `OVERLAP_NATIVE=0`) keeps oneDNN for every size.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
import torch.nn.functional as F

from overlap.engine.model import native
from overlap.engine.model.quant.kernels import QuantMethod, quantized_method
from overlap.engine.model.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)

# Rows oneDNN's packed layout is chosen for; it serves any row count with identical results.
PACKED_ROWS = 32
# Sums in another order: a bf16 output may differ from oneDNN's by a rounding or two.
_CLOSE = {torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


class LinearBackend:
    """F.linear everywhere; `fuses_silu` is False and weights stay as they are."""

    name = "torch linear"
    fuses_silu = False
    quantized_kernels = False  # quantized weights through the CPU's int kernels (else dequantized at load)
    quantized_triton = False  # quantized weights through Triton kernels (the device paths with Triton)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def linear_silu(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.silu(F.linear(x, weight, bias))

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


class OneDnnBackend(LinearBackend):
    """oneDNN's linear with prepacked weights and SiLU fused into the gate matmul (CPU, fp32 and bf16); where
    `rows_kernel` is set, decode-sized steps through the native kernel on the same packed weights."""

    fuses_silu = True

    def __init__(self) -> None:
        self._op = torch.ops.mkldnn._linear_pointwise
        self._reorder = torch.ops.mkldnn._reorder_linear_weight
        self.rows_kernel: native.PackedLinearKernel | None = None
        self._layouts: dict[tuple[int, int, torch.dtype], bool] = {}  # (n, k, dtype): the kernel reads oneDNN's
        self.rows_max = 0  # the most rows of x the native kernel takes in this backend's dtype

    @property
    def name(self) -> str:
        rows = "" if self.rows_kernel is None else f", native {self.rows_kernel.isa} kernel for <= {self.rows_max} rows"
        return f"oneDNN linear, weights prepacked{rows}"

    def rows_handle(self, weight: torch.Tensor) -> tuple[int, int, int] | None:
        """(address, n, k) of a packed weight the native kernel reads, or None: it keeps oneDNN. oneDNN picks the
        layout per shape (a plain one for some small ones, of the same size at times), so one row through both says
        whether this weight's is the kernel's; once per shape (a mixture of experts has hundreds of one shape)."""
        kernel = self.rows_kernel
        if kernel is None or weight.layout != torch._mkldnn or weight.dtype not in kernel.dtypes:
            return None
        n, k = weight.shape
        dtype = weight.dtype
        if (dtype == torch.bfloat16 and k % 2) or torch.ops.mkldnn._nbytes(weight) != kernel.packed_bytes(n, k, dtype):
            return None
        handle = torch.ops.mkldnn.data_ptr(weight), n, k
        if (n, k, dtype) not in self._layouts:
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)).to(dtype)
            with torch.inference_mode():
                ours, theirs = kernel(x, *handle, None, False).float(), self.linear(x, weight).float()
            # within rounding of the largest output (a long sum's error grows with its terms, not with each output)
            tolerance = _CLOSE[dtype]["atol"] * max(1.0, float(theirs.abs().max()))
            self._layouts[n, k, dtype] = torch.allclose(ours, theirs, atol=tolerance, rtol=_CLOSE[dtype]["rtol"])
        return handle if self._layouts[n, k, dtype] else None

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
    """oneDNN on CPU in fp32 and bf16 where it computes what F.linear does; F.linear otherwise. On CPU, quantized
    weights run through the int kernels (quant/kernels.py)."""
    plain = LinearBackend()
    plain.quantized_kernels = device.type == "cpu"
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return plain
    try:
        onednn = OneDnnBackend()
        onednn.quantized_kernels = True
        onednn.rows_kernel = _rows_kernel(onednn, dtype)  # None: oneDNN serves every size
        onednn.rows_max = 0 if onednn.rows_kernel is None else onednn.rows_kernel.rows[dtype]
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


def _rows_kernel(onednn: OneDnnBackend, dtype: torch.dtype) -> native.PackedLinearKernel | None:
    """The native decode-size kernel where it has `dtype` on this CPU (bf16: only without AMX), oneDNN packs weights
    in the layout it reads, and it computes what oneDNN does; None otherwise."""
    if os.environ.get("OVERLAP_NATIVE_LINEAR", "1") == "0":  # oneDNN alone, to compare against
        return None
    kernel = native.packed_linear_kernel()
    if kernel is None or dtype not in kernel.dtypes or (dtype == torch.bfloat16 and native.cpu_isa() == "AMX-BF16"):
        return None
    # Each value's output and input column, written into a weight and read back from oneDNN's packed copy.
    # a partial block of columns, a partial run of inputs (oneDNN limited to AVX2 packs 129-192 outputs in blocks of 16)
    n, k = 200, 98
    cols, ins = torch.arange(n).view(n, 1).expand(n, k), torch.arange(k).view(1, k).expand(n, k)
    block_cols, paired, size = kernel.BLOCK_COLS, kernel.PAIRED[dtype], kernel.packed_bytes(n, k, dtype)
    pos = torch.arange(size // dtype.itemsize)
    per_block = block_cols * kernel.padded_k(k, dtype)
    block, inner = pos // per_block, pos % per_block
    expected_col = block * block_cols + inner % (paired * block_cols) // paired
    expected_in = inner // (paired * block_cols) * paired + inner % paired
    real = (expected_col < n) & (expected_in < k)

    def packed_values(values: torch.Tensor) -> torch.Tensor:  # bf16 holds the integers below 256 exactly
        packed = onednn.pack(values.to(dtype))
        if packed.layout != torch._mkldnn or torch.ops.mkldnn._nbytes(packed) != size:
            raise ValueError("not the packed layout")
        raw = bytearray(ctypes.string_at(torch.ops.mkldnn.data_ptr(packed), size))
        return torch.frombuffer(raw, dtype=dtype).long()

    previous = onednn.rows_kernel
    onednn.rows_kernel = kernel
    try:
        got_col = packed_values(cols % 256) + 256 * packed_values(cols // 256)
        got_in = packed_values(ins % 256) + 256 * packed_values(ins // 256)
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((9, k), (n, k), (n,)))
        with torch.inference_mode():
            packed = onednn.pack(w)
            handle = onednn.rows_handle(packed)
            same = handle is not None and all(
                torch.allclose(kernel(x, *handle, b, silu).float(), onednn_fn(x, packed, b).float(), **_CLOSE[dtype])
                for silu, onednn_fn in ((False, onednn.linear), (True, onednn.linear_silu))
            )
    except (ValueError, RuntimeError, AttributeError) as exc:
        log.info("native %s linear not used: %s", dtype, exc)
        return None
    finally:
        onednn.rows_kernel = previous
    if not (torch.equal(got_col[real], expected_col[real]) and torch.equal(got_in[real], expected_in[real]) and same):
        log.info("native %s linear not used: oneDNN's packed layout or results differ on this CPU", dtype)
        return None
    return kernel


class Linear:
    """y = x W^T + b through the backend, W packed for it once; decode-sized x through the backend's native rows
    kernel where it has one for this weight. A quantized W runs through the method picked for it on this machine
    (`quantized_method`), or is dequantized here once where none fits. With LoRA (`lora`, model/lora.py) each
    adapter's delta is added after the base kernel, whatever that kernel is."""

    __slots__ = ("backend", "bias", "dequantized", "lora", "quant", "rows", "rows_max", "weight")

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
                 backend: LinearBackend) -> None:  # fmt: skip
        self.backend = backend
        self.bias = bias
        self.rows, self.rows_max = None, 0  # (kernel, address, n, k) for x of at most rows_max rows
        self.lora = None  # a LoraDelta where adapters are enabled
        self.quant: QuantMethod | None = None
        self.dequantized = isinstance(weight, QuantizedWeight)
        if self.dequantized:
            self.quant = quantized_method(weight, weight.dtype, backend.quantized_kernels, backend.quantized_triton)
            if self.quant is not None:
                self.weight, self.dequantized = None, False
                return
            weight = weight.dequantize(weight.dtype)
        self.weight = backend.pack(weight)
        kernel = getattr(backend, "rows_kernel", None)
        if kernel is not None and (bias is None or bias.dtype == weight.dtype):
            handle = backend.rows_handle(self.weight)
            if handle is not None:
                self.rows, self.rows_max = (kernel, *handle), backend.rows_max

    @property
    def kernel(self) -> str:
        """What computes this projection, for the engine's info."""
        if self.quant is not None:
            return self.quant.name
        return f"{self.backend.name} (dequantized at load)" if self.dequantized else self.backend.name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.batch.current is not None:
            return self.lora.apply(x, self._base(x))
        return self._base(x)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)
            return y if self.bias is None else y.add_(self.bias)
        if 0 < x.shape[0] <= self.rows_max and self.rows[0].reads_rows_of(x):
            kernel, address, n, k = self.rows
            return kernel(x, address, n, k, self.bias, False)
        return self.backend.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """SiLU(x W^T + b), in one pass where the backend fuses it (not with an adapter's delta to add first)."""
        if self.quant is not None or (self.lora is not None and self.lora.batch.current is not None):
            return F.silu(self(x))
        if 0 < x.shape[0] <= self.rows_max and self.rows[0].reads_rows_of(x):
            kernel, address, n, k = self.rows
            return kernel(x, address, n, k, self.bias, True)
        return self.backend.linear_silu(x, self.weight, self.bias)
