"""Paged attention for GPUs as one Triton kernel: a whole step's attention (decodes and prompt chunks together) in one
launch per layer, reading K and V in place through each sequence's block table.

Layout (the runner's pool): k_pool / v_pool [slots, kv_heads, head_dim] for one layer, slot = table[pos // bs] * bs
+ pos % bs. Queries are packed without padding: q [tokens, heads, head_dim], sequence i owning rows
q_starts[i] .. q_starts[i] + q_lens[i] - 1, which sit at positions kv_lens[i] - q_lens[i] .. kv_lens[i] - 1 (causal
and lower-right aligned: a decode, a prompt chunk after cached positions, and a prefix-cache hit are one case).

A program takes one KV head of one sequence and a tile of its queries: BLOCK_Q query tokens times every query head
that shares the KV head (grouped-query attention), as ROWS = BLOCK_Q x GROUP_P2 rows of one matrix. Each K/V tile of
BLOCK_N positions is loaded once per program and serves all of the group's heads: for a decode, one K/V read per KV
head instead of one per query head. The softmax is the online one (running max and sum, fp32), so nothing of size
[queries, keys] is ever materialised, and keys past the tile's last query (causal) or before its window are never
loaded. Positions are gathered slot by slot through the block table, so any fragmentation reads the same way.

Sizes: `tl.dot` needs every side >= 16, so a decode-only step runs one query per program with the head group padded
to 16 rows, and a step with prompt chunks runs 64-row tiles. A mixed step uses the chunk tiles for its decodes too:
their padded rows cost tensor-core arithmetic, not memory traffic, which is what a decode is bound by.

Soft-capping (Gemma 2) caps each scaled score s at softcap * tanh(s / softcap) before the online softmax; the kernel
works in log2 units (exp2), so it caps s * log2(e) at softcap * log2(e), which is the same.

Attention sinks (gpt-oss): one learned logit per query head joins each row's softmax denominator and nothing else
(transformers' eager attention appends it as one more column and drops that column's weight). The kernel folds it in
once after the last K/V tile, as one more step of the online softmax with no value: the running max and sum rescaled
to max(m, sink), the sum gaining exp(sink - max).

Not here yet: split-K over the context for a small batch of long sequences (a batch-1 decode runs one program per
KV head), and fp8 KV.

Tests run these kernels on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is
imported) against a float64 reference: tests/engine/test_triton_attention.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from overlap.engine.model.staging import to_device

DECODE_ROWS = 16  # rows of a decode-only step's tile (tl.dot's minimum)
CHUNK_ROWS = 64  # rows of a tile when the step has prompt chunks
BLOCK_N = 64  # key positions per inner iteration
# Set before this module loads (tests on CPU); read once, as triton.jit does when it decorates the kernels.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NO_WINDOW = 1 << 30  # the window of a full-attention layer: past any position
LOG2E = 1.4426950408889634  # the kernel's softmax is in powers of 2: scores are scaled by log2(e)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 inputs in full precision (IEEE), not TF32. UPCAST widens half-precision
    inputs first, which is exact (their products fit fp32): Triton's interpreter multiplies bf16 as raw integers."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tanh(x):
    """tanh as (1 - e) / (1 + e) of e = exp(-2|x|), signed: no cancellation near 0, no overflow for large |x| (Triton
    has no tanh of its own that its interpreter runs)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    tables_ptr, q_starts_ptr, q_lens_ptr, kv_lens_ptr, prog_seq_ptr, prog_q_ptr, sinks_ptr,
    scale_log2, window, softcap_log2,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    prog = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + prog)
    q_off = tl.load(prog_q_ptr + prog)  # this tile's first query, counted within its sequence
    q_len = tl.load(q_lens_ptr + seq)
    kv_len = tl.load(kv_lens_ptr + seq)
    q_start = tl.load(q_starts_ptr + seq)

    ROWS: tl.constexpr = BLOCK_Q * GROUP_P2
    rows = tl.arange(0, ROWS)
    q_idx = q_off + rows // GROUP_P2
    in_group = rows % GROUP_P2
    row_ok = (q_idx < q_len) & (in_group < GROUP)
    head = kv_head * GROUP + in_group
    pos = kv_len - q_len + q_idx  # lower-right aligned: the last query sits at kv_len - 1
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m = tl.full([ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P2], tl.float32)
    # Keys this tile can see: up to its last query's position; from its first query's window start.
    last_q = tl.minimum(q_off + BLOCK_Q, q_len) - 1
    hi = kv_len - q_len + last_q + 1
    first_pos = kv_len - q_len + q_off
    lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(tables_ptr + seq * stride_table + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        k = tl.load(
            k_ptr + slot[None, :] * stride_ks + kv_head * stride_kh + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [D, N]
        s = _dot(q, k, IEEE, UPCAST) * scale_log2
        if SOFTCAP:
            s = _tanh(s / softcap_log2) * softcap_log2
        keep = n_ok[None, :] & (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m = m_new
    if SINKS:  # each head's sink joins the denominator: one more online-softmax step, with no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@dataclass(slots=True)
class PagedPlan:
    """One step's attention geometry for `paged_attention`, made once per step and shared by every layer.

    tables [B, max_blocks] int32 (row i: sequence i's block table, padded with 0); q_starts, q_lens, kv_lens [B]
    int32; prog_seq, prog_q [P] int32: program p takes sequence prog_seq[p]'s queries from prog_q[p] on. A padded
    sequence (q_len 0) runs a program that loads and writes nothing, which is how a CUDA graph's bucket is filled."""

    tables: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    kv_lens: torch.Tensor
    prog_seq: torch.Tensor
    prog_q: torch.Tensor
    block_q: int  # query tokens per program


def block_q_for(q_lens: list[int], group: int) -> int:
    """Query tokens per program: one when every sequence decodes (the head group padded to DECODE_ROWS rows), else
    as many as fill CHUNK_ROWS rows."""
    if max(q_lens, default=1) <= 1:
        return 1
    return max(1, CHUNK_ROWS // triton.next_power_of_2(group))


def build_plan(
    tables: list[list[int]],
    q_starts: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    group: int,
    device: torch.device,
    block_q: int | None = None,
) -> PagedPlan:
    """A step's plan from host lists, staged as one int32 buffer (pinned on CUDA) and copied to the device in one
    non-blocking copy. A sequence with q_len 0 is padding: one program that does nothing."""
    block_q = block_q or block_q_for(q_lens, group)
    prog_seq, prog_q = [], []
    for i, n in enumerate(q_lens):
        for first in range(0, max(n, 1), block_q):
            prog_seq.append(i)
            prog_q.append(first)
    width = max((len(t) for t in tables), default=1) or 1
    padded = [b for t in tables for b in (*t, *[0] * (width - len(t)))]
    flat, *parts = to_device(device, padded, q_starts, q_lens, kv_lens, prog_seq, prog_q, dtype=torch.int32)
    return PagedPlan(flat.view(len(tables), width), *parts, block_q)


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: PagedPlan,
    scale: float,
    block_size: int,
    window: int | None = None,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], k_pool / v_pool [slots, KV, D] (one layer, D contiguous) -> out [T, H, D] in q's dtype. `window`:
    a query at position p sees keys p - window < k <= p (sliding-window layers); None sees every earlier key.
    `softcap`: scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2). `sinks` [H] (gpt-oss):
    a logit per query head that joins its softmax's denominator. Rows of q that no sequence owns are left as they
    were in `out`."""
    heads, head_dim = q.shape[1:]
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or k_pool.shape[2] != head_dim or v_pool.shape != k_pool.shape:
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not fit pools {tuple(k_pool.shape)}")
    if q.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("paged attention: head_dim must be the innermost, contiguous dimension")
    group = heads // kv_heads
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"paged attention: sinks {tuple(sinks.shape)} are not one per head of q {tuple(q.shape)}")
    if out is None:
        out = torch.empty_like(q)
    group_p2 = triton.next_power_of_2(group)
    if plan.block_q == 1:
        group_p2 = max(group_p2, DECODE_ROWS)
    grid = (plan.prog_seq.shape[0], kv_heads)
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, out,
        plan.tables, plan.q_starts, plan.q_lens, plan.kv_lens, plan.prog_seq, plan.prog_q,
        plan.q_lens if sinks is None else sinks, scale * LOG2E, window or NO_WINDOW, (softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), plan.tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, BLOCK_Q=plan.block_q, BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32, UPCAST=_INTERPRETED and q.dtype != torch.float32, SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
    )  # fmt: skip
    return out
