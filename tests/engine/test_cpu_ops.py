"""The native CPU ops (`cpu_ops.c`) give what torch's ops give: RMSNorm, and RoPE with the K/V write into the paged
pool, in fp32 and bf16, on strided rows; greedy argmax with torch's ties and NaNs; a gated MLP's silu(gate) * up;
layouts the C code would misread are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlap.engine.model import native

ops = native.cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler: the runner uses torch ops")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# fp32: the same sums in another order; bf16: the kernels round once where torch rounds after each op, so a value
# may land one bf16 step (2^-8 relative) away
CLOSE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7}}


@DTYPES
def test_rms_norm_matches_torch_on_strided_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    wide = (torch.randn(7, 600, generator=gen) * 3).to(dtype)
    x = wide[:, 40:552]  # rows 600 elements apart, as a slice of a wider activation
    weight = torch.randn(512, generator=gen).to(dtype)
    got = ops.rms_norm(x, weight, 1e-5)
    expected = F.rms_norm(x.float(), (512,), weight.float(), 1e-5)  # in fp32, rounded once: what the kernel does
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), expected.to(dtype).float(), **CLOSE[dtype])
    torch.testing.assert_close(got, F.rms_norm(x, (512,), weight, 1e-5), **CLOSE[dtype])


def test_rms_norm_of_bf16_rows_takes_an_fp32_weight():
    """Gemma's 1 + w stays fp32 (transformers adds it in fp32): the norm is computed in fp32 and rounded once."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 256, generator=gen) * 3).bfloat16()
    weight = 1.0 + torch.randn(256, generator=gen) * 0.3
    got = ops.rms_norm(x, weight, 1e-6)
    expected = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight).bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), **CLOSE[torch.bfloat16])


@DTYPES
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 8, 64), (8, 2, 128), (4, 1, 80)])
def test_rope_rotates_q_and_k_in_place_and_writes_k_v_to_their_slots(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads + kv_heads)
    tokens, width = 5, (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], 1).to(dtype)  # rotate-half form, first half negated
    positions, slots = torch.tensor([0, 3, 17, 63, 9]), torch.tensor([4, 0, 11, 7, 30])
    k_pool = torch.full((32, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_pool = k_pool.clone()

    # reference: x cos + rotate_half(x) sin in fp32, rounded once
    qk = qkv[:, : (heads + kv_heads) * head_dim].float().view(tokens, heads + kv_heads, head_dim)
    rotated = torch.cat([qk[..., head_dim // 2 :], qk[..., : head_dim // 2]], -1)
    expected = (qk * cos[positions].float()[:, None] + rotated * sin[positions].float()[:, None]).to(dtype)
    expected_v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim).clone()

    ops.rope_store_kv(qkv, positions, cos, sin, slots, k_pool, v_pool, heads)
    got = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    torch.testing.assert_close(got.float(), expected.float(), **CLOSE[dtype])
    torch.testing.assert_close(k_pool[slots], got[:, heads:], rtol=0, atol=0)
    torch.testing.assert_close(v_pool[slots], expected_v, rtol=0, atol=0)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(k_pool[untouched]).all() and torch.isnan(v_pool[untouched]).all()


def test_argmax_is_torchs_with_ties_nans_and_infinities():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 5000, generator=gen)
    x = wide[:, :4099]  # strided rows, a length that is no multiple of a vector
    x[1, 7] = x[1, 4000] = x[1].max() + 1  # a tie: the first one
    x[2, 50] = x[2, 9] = float("nan")  # NaN is the largest: the first NaN
    x[3] = float("-inf")  # all -inf: 0
    x[4, 4098] = float("inf")  # the last column
    x[5, 0] = float("nan")
    torch.testing.assert_close(ops.argmax(x), x.argmax(-1), rtol=0, atol=0)
    assert ops.argmax(x[:0]).shape == (0,)
    halves = x.bfloat16()  # bf16 rows, read as they are: torch's index on the same values
    torch.testing.assert_close(ops.argmax(halves), halves.float().argmax(-1), rtol=0, atol=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread takes every row
    try:
        torch.testing.assert_close(ops.argmax(x), x.argmax(-1), rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)


@DTYPES
def test_silu_mul_is_silu_of_the_gate_times_up_rounded_once(dtype):
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 2 * 1000 + 24, generator=gen) * 6
    wide[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0, float("inf"), float("nan")])
    gate_up = wide[:, : 2 * 1000].to(dtype)  # strided rows; a width that is no multiple of a vector
    got = ops.silu_mul(gate_up)
    gate, up = gate_up[:, :1000].double(), gate_up[:, 1000:].double()
    expected = (F.silu(gate) * up).to(dtype)  # exact, rounded once
    assert got.dtype == dtype and got.shape == (6, 1000) and got.is_contiguous()
    # atol: a gate below -88.7 overflows e^-g as torch's fp32 silu does, giving 0 for what is under 1e-36 exactly
    close = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 1e-36, "rtol": 2**-8}}[dtype]
    torch.testing.assert_close(got, expected, equal_nan=True, **close)
    assert torch.isinf(got[0, 6]) and torch.isnan(got[0, 7])


def test_layouts_the_kernels_would_misread_are_refused():
    x, weight = torch.zeros(4, 64), torch.ones(64)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        ops.rms_norm(x, weight.bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="layouts"):
        ops.rms_norm(torch.zeros(64, 4).t(), weight, 1e-5)
    with pytest.raises(ValueError, match="argmax"):
        ops.argmax(torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="argmax"):
        ops.argmax(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(torch.zeros(4, 7))
    qkv, table = torch.zeros(2, 3 * 64), torch.zeros(8, 64)
    pool = torch.zeros(4, 1, 64)
    index = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="int64"):
        ops.rope_store_kv(qkv, index.int(), table, table, index, pool, pool, 1)
    with pytest.raises(ValueError, match="qkv rows"):
        ops.rope_store_kv(torch.zeros(2, 4 * 64), index, table, table, index, pool, pool, 1)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rope_store_kv(qkv, index, table, table, index, torch.zeros(8, 1, 64)[::2], pool, 1)
