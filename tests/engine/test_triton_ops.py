"""The GPU path's small per-layer kernels (Triton), run on the CPU in Triton's interpreter against the torch ops they
replace: RMSNorm over strided rows, RoPE with the K/V write (full and partial head sizes, GQA, scattered slots),
SiLU-mul; fp32 exact to rounding, bf16 within its rounding."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: the interpreter runs them on CPU
pytest.importorskip("triton")
import torch
import torch.nn.functional as F

from overlap.engine.model.layers.rotary import Rotary
from overlap.engine.model.triton_ops import TritonOps

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch_over_strided_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 200, generator=gen).to(dtype)
    x = wide[:, 24:184]  # rows with a stride past their width, as a slice of a fused projection's output
    weight = torch.randn(160, generator=gen).to(dtype)
    out = TritonOps.rms_norm(x, weight, 1e-6)
    expected = F.rms_norm(x.float(), (160,), weight.float(), 1e-6)
    assert out.dtype == dtype and out.shape == (5, 160) and out.is_contiguous()
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    assert TritonOps.rms_norm(x[:0], weight, 1e-6).shape == (0, 160)
    with pytest.raises(ValueError, match="rms_norm"):
        TritonOps.rms_norm(x, weight[:100], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (8, 1, 128), (6, 2, 96)])
def test_rope_store_kv_matches_the_torch_path(dtype, heads, kv_heads, head_dim):
    """The same rotated q, and K/V written to the same scattered slots, as Rotary's torch ops."""
    gen = torch.Generator().manual_seed(1)
    tokens, positions_max, num_slots = 7, 50, 40
    angles = torch.rand(positions_max, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], 1).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 49, 7, 7, 20, 1])
    slots = torch.tensor([39, 0, 5, 17, 18, 2, 30])
    pools = [torch.zeros(num_slots, kv_heads, head_dim, dtype=dtype) for _ in range(4)]

    torch_rotary = Rotary(cos, sin, None)
    q_ref = torch_rotary.apply_and_store(qkv.clone(), torch_rotary.at(positions), slots, pools[0], pools[1], heads)
    triton_rotary = Rotary(cos, sin, TritonOps())
    q = triton_rotary.apply_and_store(qkv.clone(), triton_rotary.at(positions), slots, pools[2], pools[3], heads)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(pools[2].float(), pools[0].float(), **TOLERANCE[dtype])  # K
    assert torch.equal(pools[3], pools[1])  # V: copied, not computed
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert not pools[2][untouched].any() and not pools[3][untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * 1500, generator=gen).to(dtype)  # an intermediate size past one block
    out = TritonOps.silu_mul(gate_up)
    expected = F.silu(gate_up[:, :1500].float()) * gate_up[:, 1500:].float()
    assert out.shape == (3, 1500) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
