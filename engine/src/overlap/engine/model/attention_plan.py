"""How each sequence of a step attends, decided once per step and shared by every layer of a kind.

A sequence's K/V slots are one run when its block table is a run of consecutive block ids (what the block manager
hands out where it can): torch ops then read them as a slice of the pool; a fragmented table is gathered by an
index made once per step. Decodes (one query token) go to the native kernel where there is one (a `DecodePlan`),
everything on CUDA to the Triton kernel (a `PagedPlan`). Sliding-window layers get a plan of their own when some
sequence reaches past the window. When some rows are not sampled (prompt chunks), the last layer, past its K/V
writes, runs only the sampled rows, each as one query over its whole context: its own plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from overlap.engine.model import native


@dataclass(slots=True)
class SeqGeometry:
    """Where one scheduled sequence sits this step: its rows, positions, and K/V slots (one run or a list)."""

    q_start: int
    n: int
    start: int
    end: int
    table: list[int]
    do_sample: bool
    kv_start: int | None = None  # first slot when its blocks are one run
    slots: list[int] | None = None  # else its slots 0 .. end - 1 (None for a decode until a torch path needs them)
    index: torch.Tensor | None = None  # those slots as a tensor, made once and shared by the step's plans


@dataclass(slots=True)
class SeqAttention:
    """How one sequence attends on the torch path (shared by all layers of a kind)."""

    q_start: int  # its rows in the packed token matrix
    q_len: int
    kv_len: int  # attends over its last kv_len positions (all of them, 0 .. end - 1, without a window)
    kv_start: int | None  # first slot when its K/V are one run of slots (read as a view)
    kv_index: torch.Tensor | None  # else the slots to gather
    mask: torch.Tensor | None  # bool [q_len, kv_len] for a chunk that does not start at position 0
    is_causal: bool  # a chunk from position 0 (q_len == kv_len): SDPA's own causal mask


class AttentionPlan(NamedTuple):
    """One layer kind's attention for a step: the kernel's plan, torch-path sequences, the last layer's plan."""

    kernel_plan: object  # native.DecodePlan of the decodes, a Triton PagedPlan of the whole step, or None
    seqs: list[SeqAttention]
    last_layer: tuple[object, list[SeqAttention]] | None


def cpu_plan(geometry: list[SeqGeometry], window: int | None, num_tokens: int, num_kept: int | None, *,
             block_size: int, use_kernel: bool, device: torch.device) -> AttentionPlan:  # fmt: skip
    """The native kernel's decodes and the torch-path sequences of a layer with this sliding window (None: full
    causal attention). A query at position p sees keys p - window < k <= p, as in transformers' mask."""
    seqs: list[SeqAttention] = []
    tables: list[list[int]] = []
    lens: list[int] = []
    rows: list[int] = []
    for g in geometry:
        lo = 0 if window is None else max(0, g.start - window + 1)  # the first key any of its queries sees
        if g.n == 1 and use_kernel and lo == 0:
            tables.append(g.table)
            lens.append(g.end)
            rows.append(g.q_start)
            continue
        mask, is_causal = None, False
        if g.n > 1:
            if g.start == 0 and (window is None or g.end <= window):
                is_causal = True  # SDPA's own causal mask
            else:
                q_pos = torch.arange(g.start, g.end, device=device)[:, None]
                k_pos = torch.arange(lo, g.end, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
        seqs.append(seq_attention(g, g.q_start, g.n, lo, mask, is_causal, block_size, device))
    last_layer = None
    sampled = [g for g in geometry if g.do_sample]
    if num_kept is None and len(sampled) < num_tokens:
        # The last layer's rows are the sampled ones, row i for sampled sequence i: one query at end - 1 each.
        kernel_rows, torch_seqs = [], []
        for i, g in enumerate(sampled):
            lo = 0 if window is None else max(0, g.end - window)
            if use_kernel and lo == 0:
                kernel_rows.append((g, i))
            else:
                torch_seqs.append(seq_attention(g, i, 1, lo, None, False, block_size, device))
        last_plan = None
        if kernel_rows:
            last_plan = native.DecodePlan([g.table for g, _ in kernel_rows], [g.end for g, _ in kernel_rows],
                                          [i for _, i in kernel_rows], block_size)  # fmt: skip
        last_layer = (last_plan, torch_seqs)
    decode_plan = native.DecodePlan(tables, lens, rows, block_size) if tables else None
    return AttentionPlan(decode_plan, seqs, last_layer)


def triton_plan(geometry: list[SeqGeometry], num_tokens: int, num_kept: int | None, *, triton, group: int,
                device: torch.device) -> AttentionPlan:  # fmt: skip
    """The Triton kernel's plans: every sequence of the step (the kernel applies each layer's window itself), and
    when some rows are not sampled the last layer's, one query per sampled sequence at its last position."""
    plan = triton.build_plan([g.table for g in geometry], [g.q_start for g in geometry], [g.n for g in geometry],
                             [g.end for g in geometry], group, device)  # fmt: skip
    sampled = [g for g in geometry if g.do_sample]
    last_layer = None
    if num_kept is None and len(sampled) < num_tokens:
        last = triton.build_plan([g.table for g in sampled], list(range(len(sampled))), [1] * len(sampled),
                                 [g.end for g in sampled], group, device)  # fmt: skip
        last_layer = (last, [])
    return AttentionPlan(plan, [], last_layer)


def seq_attention(g: SeqGeometry, q_start: int, q_len: int, lo: int, mask, is_causal: bool, block_size: int,
                  device: torch.device) -> SeqAttention:  # fmt: skip
    """Sequence g's queries (rows q_start .. q_start + q_len - 1) attending over its positions lo .. end - 1."""
    if g.kv_start is not None:
        return SeqAttention(q_start, q_len, g.end - lo, g.kv_start + lo, None, mask, is_causal)
    if g.index is None:
        slots = g.slots or [g.table[p // block_size] * block_size + p % block_size for p in range(g.end)]
        g.index = torch.tensor(slots, device=device)
    return SeqAttention(q_start, q_len, g.end - lo, None, g.index[lo:], mask, is_causal)
