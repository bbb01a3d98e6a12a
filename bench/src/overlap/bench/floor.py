"""The physical floor of a decode step, measured in the same process as the step: the time to read the bytes it
must read (every weight once, the embedding rows aside, and the K/V of every sequence up to its context) at the
memory read bandwidth, or the time to do its arithmetic at the machine's matmul peak, whichever is longer. A step
can run no faster than that; `step / floor` says how far from it a figure is, and `bound` which of the two holds."""

from __future__ import annotations

import time


def decode_floor_bytes(runner, batch: int, context: float) -> float:
    """What a decode step of `batch` sequences at `context` positions must read: the weights it streams
    (`runner.weight_bytes`) and their K/V."""
    from overlap.engine.model.model_spec import kv_bytes_per_token

    return runner.weight_bytes + batch * context * kv_bytes_per_token(runner.spec, runner.dtype)


def decode_flops(runner, batch: int, context: float) -> float:
    """A decode step's arithmetic: two FLOPs per streamed weight per sequence (the projections and the LM head),
    and four per cached position per query head dimension (q.k and p.v)."""
    spec = runner.spec
    params = runner.weight_params
    attention = 4 * context * spec.num_heads * spec.head_dim * spec.num_layers
    return batch * (2 * params + attention)


def projection_params(spec) -> int:
    """Weights of the decoder's projections (q, k, v, o, gate, up, down of every layer): what a W8A8 format makes
    int8."""
    h, d = spec.hidden_size, spec.head_dim
    attention = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    return spec.num_layers * (attention + 3 * h * spec.intermediate_size)


def decode_compute_floor(runner, batch: int, context: float, peak: float, int8_peak: float = 0.0) -> float:
    """Seconds of a decode step's arithmetic (`decode_flops`) at the measured peak of the instruction each part runs:
    with `int8_peak` (a W8A8 runner: `cpu_int8_matmul_peak`), the decoder's projections at it and the LM head and
    attention at `peak`; else all of it at `peak`."""
    flops = decode_flops(runner, batch, context)
    if not int8_peak:
        return flops / peak
    int8_ops = 2 * batch * projection_params(runner.spec)
    return int8_ops / int8_peak + (flops - int8_ops) / peak


def cpu_read_bandwidth(nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """Bytes per second a reduction over `nbytes` reads with torch's current threads (best of `rounds`): a sum of
    int64s does one add per 8 bytes, so memory, not arithmetic, bounds it. Larger than the last-level cache."""
    import torch

    data = torch.ones(nbytes // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def cpu_matmul_peak(dtype, rounds: int = 5) -> float:
    """FLOP/s of a large matmul in `dtype` through the linear backend the runner picks on this machine (best of
    `rounds`, torch's current threads): compute-bound (256 rows against a 2048 x 2048 weight that stays in cache)."""
    import torch

    from overlap.engine.model.layers.linear import pick_linear_backend

    backend = pick_linear_backend(torch.device("cpu"), dtype)
    rows, width = 256, 2048
    x = torch.randn(rows, width).to(dtype)
    weight = backend.pack(torch.randn(width, width).to(dtype))
    best = float("inf")
    with torch.inference_mode():
        backend.linear(x, weight)
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(4):
                backend.linear(x, weight)
            best = min(best, (time.perf_counter() - start) / 4)
    return 2 * rows * width * width / best


def cpu_int8_matmul_peak(rounds: int = 5) -> float:
    """Operations/s (two a multiply-add) of a large int8 x int8 -> int32 matmul, activations quantized per token, on
    the same sizes as `cpu_matmul_peak`: the faster of the W8A8 kernel the runner picks (quant_w8a8.c, VNNI where
    the CPU has it) and oneDNN's u8 x s8 matmul on the same weight, so the kernel is not its own yardstick; 0 where
    no int8 matmul runs here."""
    import torch

    from overlap.engine.model.quant.kernels import NativeW8A8, onednn_int8, quantized_method, signed_int8
    from overlap.engine.model.quant.weight import WeightScheme, random_quantized

    rows, width = 256, 2048
    weight = random_quantized(width, width, WeightScheme(8, width, act_bits=8), "peak", torch.device("cpu"),
                              torch.Generator().manual_seed(0), torch.bfloat16)  # fmt: skip
    method = quantized_method(weight, torch.bfloat16, cpu_paths=True)
    if not isinstance(method, NativeW8A8):
        return 0.0
    x = torch.randn(rows, width).bfloat16()
    runs = [lambda x: method.kernel.w8a8(x, method.packed, method.rowsum, method.scale, x.dtype)]
    if method.onednn is None:  # where the kernel serves every size, oneDNN on a copy of its own
        method.onednn = onednn_int8(signed_int8(weight.codes))
    if method.onednn is not None:  # None: a torch build without oneDNN's int8 ops
        runs.append(lambda x: method.onednn_matmul(x, x.dtype))
    best = float("inf")
    with torch.inference_mode():
        for run in runs:
            run(x)
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(4):
                    run(x)
                best = min(best, (time.perf_counter() - start) / 4)
    return 2 * rows * width * width / best
