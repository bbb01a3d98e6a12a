"""The native projection kernel for decode-sized steps (`linear_packed.c`): it reads oneDNN's packed weights and must
compute what oneDNN computes, in fp32 and bf16, at every row count it takes and on every shape edge of the packed
layout; in bf16 it is picked only where the CPU has AVX512-BF16 and no AMX. Its AVX2 path (fp32) is built and checked
on every machine that has AVX2, against oneDNN limited to AVX2 too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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
@pytest.mark.parametrize(("n", "k"), [(258, 98), (64, 32), (200, 896), (16, 34)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_kernel_computes_what_onednn_does(dtype, n, k, with_bias):
    """Every row count the kernel takes, whatever this CPU's limit for handing rows to it (`rows_max`) is."""
    backend = _backend(dtype)
    gen = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    layer = Linear(weight, bias, backend)
    # every one of these shapes goes to the kernel, for as many rows as this CPU's limit says
    assert layer.rows is not None and layer.rows_max == backend.rows_kernel.rows[dtype]
    kernel, address, _, _ = layer.rows
    with torch.inference_mode():
        for rows in (1, 5, 6, 7, 16, 48, kernel.MAX_ROWS):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            onednn = backend.linear(x, layer.weight, bias).float()
            got = kernel(x, address, n, k, bias, False).float()
            torch.testing.assert_close(got, onednn, **CLOSE[dtype])
            torch.testing.assert_close(got, expected, **CLOSE[dtype])
            torch.testing.assert_close(kernel(x, address, n, k, bias, True).float(), F.silu(expected), **CLOSE[dtype])
            torch.testing.assert_close(layer(x).float(), expected, **CLOSE[dtype])  # the kernel or oneDNN, by rows
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


def _avx2_kernel() -> native.PackedLinearKernel:
    if native.cpu_isa() not in ("AVX2", "AVX-512", "AVX512-BF16", "AMX-BF16"):
        pytest.skip(f"this CPU ({native.cpu_isa()}) has no AVX2")
    kernel = native.packed_linear_kernel("x86-64-v3")
    assert kernel is not None and kernel.dtypes == (torch.float32,)  # AVX2 has no bf16 arithmetic
    return kernel


@pytest.mark.parametrize(("n", "k"), [(258, 98), (64, 32), (16, 34)])
def test_the_avx2_path_computes_what_onednn_does(monkeypatch, n, k):
    """The AVX2 build against this CPU's oneDNN: fp32 weights are packed in the same layout on AVX-512 and AVX2."""
    avx2 = _avx2_kernel()
    monkeypatch.setattr(native, "packed_linear_kernel", lambda: avx2)
    backend = pick_linear_backend(CPU, torch.float32)
    assert backend.rows_kernel is not None
    gen = torch.Generator().manual_seed(n + k)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    layer = Linear(weight, bias, backend)
    assert layer.rows is not None
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 7, layer.rows_max):
            x = torch.randn(rows, k, generator=gen)
            expected = F.linear(x, weight, bias)
            torch.testing.assert_close(layer(x), expected, **CLOSE[torch.float32])
            torch.testing.assert_close(layer.silu(x), F.silu(expected), **CLOSE[torch.float32])


def test_onednn_limited_to_avx2_packs_what_the_avx2_path_reads():
    """On an AVX2-only CPU oneDNN picks its AVX2 kernels and layouts; ONEDNN_MAX_CPU_ISA=AVX2 makes it do so here
    (in a process of its own: oneDNN reads it once). The runner takes the AVX2 kernel for the 0.5B shape's
    projections and leaves the narrow shapes oneDNN blocks by 16 columns to oneDNN."""
    _avx2_kernel()
    script = textwrap.dedent("""
        import json, torch
        from overlap.engine.model import native
        from overlap.engine.model.layers.linear import Linear, pick_linear_backend
        avx2 = native.packed_linear_kernel("x86-64-v3")
        native.packed_linear_kernel = lambda: avx2
        backend = pick_linear_backend(torch.device("cpu"), torch.float32)
        taken = {}
        for n, k in ((1152, 896), (9728, 896), (896, 4864), (160, 98)):
            weight, x = torch.randn(n, k), torch.randn(4, k)
            layer = Linear(weight, None, backend)
            torch.testing.assert_close(layer(x), x @ weight.t(), atol=1e-3, rtol=1e-4)
            taken[f"{n}x{k}"] = layer.rows is not None
        print(json.dumps({"kernel": backend.rows_kernel is not None, "taken": taken}))
    """)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"kernel": True, "taken": {"1152x896": True, "9728x896": True, "896x4864": True, "160x98": False}}


def _sparse_moe(dtype: torch.dtype, backend, experts: int = 8, hidden: int = 256, inter: int = 160):
    from overlap.engine.model.experts import ExpertWeights, MoeSpec
    from overlap.engine.model.layers.moe import SparseMoE

    gen = torch.Generator().manual_seed(experts * hidden + inter)
    weights = ExpertWeights(router=torch.randn(experts, hidden, generator=gen).to(dtype),
                            gate_up=(torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(dtype),
                            down=(torch.randn(experts, hidden, inter, generator=gen) / 8).to(dtype))  # fmt: skip
    reference = (weights.gate_up.float(), weights.down.float())
    spec = MoeSpec(num_experts=experts, top_k=2, intermediate_size=inter, norm_topk_prob=True, weights_fp32=False,
                   shared_intermediate_size=0, sparse=(True,), prefix="mlp")  # fmt: skip
    return SparseMoE(weights, spec, backend), reference


def _each_expert_through(moe, kernel) -> None:
    """Each expert's own gate, up and down calls through the kernel at every row count it takes, as the one call is."""
    for mlp in moe.experts:
        for linear in (mlp.gate, mlp.up, mlp.down):
            linear.rows_max = kernel.MAX_ROWS


def _experts_reference(x, ids, weight, gate_up, down):
    """Each row's experts' outputs in fp32, each times `weight`, summed over its slots."""
    inter = down.shape[2]
    out = torch.zeros(x.shape[0], down.shape[1])
    for row, slots in enumerate(ids.tolist()):
        for expert in slots:
            h = x[row].float() @ gate_up[expert].t()
            out[row] += weight * ((F.silu(h[:inter]) * h[inter:]) @ down[expert].t())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_expert_in_one_call_equals_each_expert_alone(dtype, monkeypatch):
    """A mixture of experts' decode-sized step in one kernel call (`overlap_experts_packed`) gives, bit for bit, what
    each expert's own gate, up and down calls through the kernel give, for experts with no rows, one row, and several
    row tiles, and an intermediate width that ends inside a column block; with an expert over the kernel's rows the
    step goes expert by expert."""
    backend = _backend(dtype)
    moe, (gate_up, down) = _sparse_moe(dtype, backend)
    assert moe.native is not None
    kernel = moe.native[0]
    _each_expert_through(moe, kernel)
    calls = []
    monkeypatch.setattr(kernel, "experts", lambda *args, fn=kernel.experts: calls.append(args[1].tolist()) or fn(*args))
    gen = torch.Generator().manual_seed(5)
    cases = {
        "one row": torch.tensor([[3, 5]]),
        "uneven": torch.tensor([[0, 1]] * 9 + [[1, 2]] * 4 + [[7, 0]]),  # 10, 13, 4 and 1 rows; four experts idle
        "too many for one call": torch.tensor([[0, 1]] * (kernel.MAX_ROWS + 1)),
    }
    with torch.inference_mode():
        for name, ids in cases.items():
            x = torch.randn(ids.shape[0], 256, generator=gen).to(dtype)
            weights = torch.full(ids.shape, 0.5, dtype=dtype)
            calls.clear()
            one_call = moe.grouped(x, weights, ids)
            native, moe.native = moe.native, None
            try:
                alone = moe.grouped(x, weights, ids)
            finally:
                moe.native = native
            assert len(calls) == (0 if name == "too many for one call" else 1), name
            assert torch.equal(one_call, alone), name
            expected = _experts_reference(x, ids, 0.5, gate_up, down)
            scale = max(1.0, float(expected.abs().max()))  # within rounding of the largest output, as the layout check
            torch.testing.assert_close(one_call.float(), expected, atol=CLOSE[dtype]["atol"] * scale, rtol=0)


def test_the_avx2_path_runs_every_expert_in_one_call(monkeypatch):
    """The same in fp32 through the kernel's AVX2 build."""
    avx2 = _avx2_kernel()
    monkeypatch.setattr(native, "packed_linear_kernel", lambda: avx2)
    backend = pick_linear_backend(CPU, torch.float32)
    moe, (gate_up, down) = _sparse_moe(torch.float32, backend)
    assert moe.native is not None and moe.native[0] is avx2
    _each_expert_through(moe, avx2)
    ids = torch.tensor([[0, 1]] * 7 + [[6, 2]] * 3 + [[5, 0]])
    x = torch.randn(ids.shape[0], 256, generator=torch.Generator().manual_seed(6))
    weights = torch.full(ids.shape, 0.5)
    with torch.inference_mode():
        one_call = moe.grouped(x, weights, ids)
        moe.native = None
        alone = moe.grouped(x, weights, ids)
    assert torch.equal(one_call, alone)
    torch.testing.assert_close(one_call, _experts_reference(x, ids, 0.5, gate_up, down), **CLOSE[torch.float32])


@pytest.mark.parametrize(
    ("vendor", "family", "splits"),
    [("AuthenticAMD", 25, True), ("AuthenticAMD", 26, False), ("GenuineIntel", 6, False)],
    ids=["zen4", "zen5", "intel"],
)
def test_the_rows_the_kernel_takes_follow_how_the_cpu_runs_512_bit_ops(tmp_path, monkeypatch, vendor, family, splits):
    """Zen 4 splits each 512-bit instruction in two, so oneDNN's compute-bound kernels run at half rate there and
    the kernel takes up to 64 rows in bf16; a CPU that runs them whole hands it only the few rows where streaming
    binds (docs/engine.md, "Real sizes")."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: 17\n")
    assert native.splits_512_bit_ops(cpuinfo) is splits
    library = native._library("overlap_linear")
    if library is None or library.overlap_linear_packed_isa() != 512:
        pytest.skip(f"no AVX-512 build of the kernel on this CPU ({native.cpu_isa()})")
    monkeypatch.setattr(native, "splits_512_bit_ops", lambda: splits)
    rows = native.PackedLinearKernel(library).rows
    assert rows == (native.PackedLinearKernel.ROWS_SPLIT_512 if splits else native.PackedLinearKernel.ROWS_WHOLE_512)
    assert rows[torch.bfloat16] == (64 if splits else 8)
