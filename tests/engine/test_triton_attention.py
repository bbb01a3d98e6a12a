"""The GPU path's paged attention kernel (Triton), run on the CPU in Triton's interpreter against a float64 reference:
decodes, prompt chunks after cached positions (prefix hits), mixed steps, fragmented block tables, GQA ratios 1, 4
and 8, head sizes 64, 128 and 80, sliding windows, long contexts, padding rows, fp32 and bf16."""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: the interpreter runs them on CPU
pytest.importorskip("triton")
import torch

from overlap.engine.model import triton_attention as ta


def reference(q, k_pool, v_pool, tables, q_starts, q_lens, kv_lens, scale, block_size, window=None, softcap=None,
              sinks=None):  # fmt: skip
    """float64 attention per sequence from the block tables, lower-right aligned causal (and windowed, and
    soft-capped, and with each head's sink as one more column of scores whose weight is dropped)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    group = heads // kv_heads
    for table, q0, n, kv in zip(tables, q_starts, q_lens, kv_lens, strict=True):
        if n == 0:
            continue
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(kv)])
        k = k_pool[slots].double().repeat_interleave(group, dim=1)  # [kv, H, D]
        v = v_pool[slots].double().repeat_interleave(group, dim=1)
        qs = q[q0 : q0 + n].double()  # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(kv - n, kv)[:, None]
        k_pos = torch.arange(kv)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            column = sinks.double().view(-1, 1, 1).expand(-1, n, 1)
            probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        out[q0 : q0 + n] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def make_step(specs, *, heads, kv_heads, head_dim, block_size, dtype, fragmented, seed=0):
    """specs: (q_len, kv_len) per sequence. Random q and pools; each sequence gets its own blocks from a shuffled
    (fragmented) or consecutive run of block ids."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-kv // block_size) for _, kv in specs]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    if fragmented:
        rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    q_lens = [n for n, _ in specs]
    q_starts = [sum(q_lens[:i]) for i in range(len(specs))]
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k_pool, v_pool, tables, q_starts, q_lens, [kv for _, kv in specs]


def run_and_compare(specs, *, heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                    fragmented=True, window=None, seed=0, softcap=None, sinks=None):  # fmt: skip
    q, k_pool, v_pool, tables, q_starts, q_lens, kv_lens = make_step(
        specs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
        fragmented=fragmented, seed=seed,
    )  # fmt: skip
    scale = head_dim**-0.5
    plan = ta.build_plan(tables, q_starts, q_lens, kv_lens, heads // kv_heads, torch.device("cpu"))
    got = ta.paged_attention(q, k_pool, v_pool, plan, scale, block_size, window, softcap=softcap, sinks=sinks)
    want = reference(q, k_pool, v_pool, tables, q_starts, q_lens, kv_lens, scale, block_size, window, softcap, sinks)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2  # bf16 rounds p before P.V, and the output once
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)
    return plan


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch_fragmented(heads, kv_heads, head_dim):
    plan = run_and_compare([(1, 1), (1, 17), (1, 64), (1, 100), (1, 161)], heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim)  # fmt: skip
    assert plan.block_q == 1 and plan.prog_seq.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
def test_prefill_chunks_and_prefix_hits(heads, kv_heads):
    # a whole prompt, a chunk after 40 cached positions (a prefix hit or a later chunk), a chunk past a tile's end
    plan = run_and_compare([(37, 37), (24, 64), (70, 150)], heads=heads, kv_heads=kv_heads)
    assert plan.block_q == ta.CHUNK_ROWS // (heads // kv_heads)


@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "fragmented"])
def test_mixed_step_of_decodes_and_chunks(fragmented):
    run_and_compare([(1, 30), (45, 45), (1, 129), (16, 80), (1, 2)], fragmented=fragmented)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size):
    run_and_compare([(1, 70), (20, 90)], block_size=block_size)


def test_head_size_that_is_no_power_of_two():
    run_and_compare([(1, 50), (9, 33)], heads=4, kv_heads=2, head_dim=80)


@pytest.mark.parametrize("window", [1, 16, 50])
def test_sliding_window(window):
    run_and_compare([(1, 120), (33, 100), (70, 70)], window=window)


def test_soft_capping():
    """Gemma 2: scores capped at cap * tanh(s / cap); a cap of 0.5 bends the scale-0.125 scores of randn inputs."""
    run_and_compare([(1, 70), (20, 90)], softcap=0.5, window=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks(dtype):
    """gpt-oss: each head's sink joins its softmax's denominator, over decodes and chunks, windowed; sinks above,
    among and below the scores (and one a query's only key cannot outweigh)."""
    sinks = torch.tensor([6.0, -3.0, 0.5, 1.0, 0.0, -0.7, 2.5, 40.0])
    run_and_compare([(1, 1), (1, 70), (20, 90), (33, 33)], sinks=sinks, window=48, dtype=dtype)


def test_long_context():
    run_and_compare([(1, 4000), (64, 2500)], heads=8, kv_heads=1, head_dim=64)


def test_bfloat16():
    run_and_compare([(1, 77), (24, 64), (1, 300)], dtype=torch.bfloat16)


def test_padding_sequences_write_nothing():
    """A padded sequence (q_len 0, kv_len 0), as a CUDA graph's bucket holds, runs a program that leaves out alone."""
    q, k_pool, v_pool, tables, q_starts, q_lens, kv_lens = make_step(
        [(1, 20), (1, 40)], heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, fragmented=True
    )
    plan = ta.build_plan([*tables, [], []], [*q_starts, 2, 2], [*q_lens, 0, 0], [*kv_lens, 0, 0], 4,
                         torch.device("cpu"), block_q=1)  # fmt: skip
    out = torch.full((3, 8, 64), 7.0)
    ta.paged_attention(q.new_zeros(3, 8, 64).copy_(torch.cat([q, q[:1]])), k_pool, v_pool, plan, 0.125, 16, out=out)
    want = reference(q, k_pool, v_pool, tables, q_starts, q_lens, kv_lens, 0.125, 16)
    torch.testing.assert_close(out[:2].double(), want, atol=2e-5, rtol=2e-5)
    assert torch.all(out[2] == 7.0)


def test_mismatched_pools_are_refused():
    q = torch.zeros(1, 6, 64)
    pools = torch.zeros(16, 4, 64)
    plan = ta.build_plan([[0]], [0], [1], [1], 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        ta.paged_attention(q, pools, pools, plan, 1.0, 16)
