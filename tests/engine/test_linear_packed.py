"""The native projection kernel for decode-sized steps (`linear_packed.c`): it reads oneDNN's packed weights and must
compute what oneDNN computes, in fp32 and bf16, at every row count it takes and on every shape edge of the packed
layout; in bf16 it is picked only where the CPU has AVX512-BF16 and no AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlap.engine.model import native
from overlap.engine.model.layers import linear as linear_module
from overlap.engine.model.layers.linear import Linear, OneDnnBackend, pick_linear_backend

CPU = torch.device("cpu")
CLOSE = {torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


def _backend(dtype: torch.dtype) -> OneDnnBackend:
    picked = pick_linear_backend(CPU, dtype)
    if getattr(picked, "rows_kernel", None) is None:
        pytest.skip(f"no native {dtype} rows kernel on this CPU ({native.cpu_isa()}): oneDNN serves every size")
    return picked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(130, 98), (64, 32), (200, 896), (16, 34)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_kernel_computes_what_onednn_does(dtype, n, k, with_bias):
    backend = _backend(dtype)
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    layer = Linear(weight, bias, backend)
    assert layer.rows is not None and layer.rows_max >= 48  # every one of these shapes goes to the kernel
    with torch.inference_mode():
        for rows in (1, 5, 6, 7, 16, layer.rows_max):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            onednn = backend.linear(x, layer.weight, bias).float()
            got = layer(x).float()
            torch.testing.assert_close(got, onednn, **CLOSE[dtype])
            torch.testing.assert_close(got, expected, **CLOSE[dtype])
            torch.testing.assert_close(layer.silu(x).float(), F.silu(expected), **CLOSE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_kernel_takes_strided_rows_and_hands_the_rest_to_onednn(dtype, monkeypatch):
    backend = _backend(dtype)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    layer = Linear(weight, None, backend)
    wide = torch.randn(70, 130, generator=gen).to(dtype)
    calls = []
    monkeypatch.setattr(backend, "linear", lambda x, *args, fn=backend.linear: calls.append(x.shape[0]) or fn(x, *args))
    too_many = layer.rows_max + 1
    with torch.inference_mode():
        assert layer(wide[:0, :64]).shape == (0, 96)  # no rows: oneDNN's
        # rows 130 elements apart; the same from an odd element (bf16 reads pairs: oneDNN's); more rows than it takes
        for x in (wide[:8, :64], wide[:8, 1:65], wide[:too_many, :64]):
            expected = F.linear(x.float(), weight.float())
            torch.testing.assert_close(layer(x).float(), expected, **CLOSE[dtype])
    assert calls == ([0, 8, too_many] if dtype == torch.bfloat16 else [0, too_many])


def test_amx_cpus_keep_onednn_in_bf16(monkeypatch):
    monkeypatch.setattr(native, "cpu_isa", lambda: "AMX-BF16")
    assert linear_module._rows_kernel(OneDnnBackend(), torch.bfloat16) is None
