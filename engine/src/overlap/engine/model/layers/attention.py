"""Paged attention of one layer over the KV pool, read in place: the three ways a step's attention runs.

- **Triton** (CUDA): every sequence of the step, prompt chunks included, in one launch (`triton_attention.py`).
- **native** (CPU, fp32 or bf16): the step's decodes in one call of the C kernel (`paged_attention.c`), which walks
  each sequence's block table and streams its K and V rows once; torch's OpenMP threads share the sequences when
  the batch runs whole. Prompt chunks take the torch path.
- **torch**: per-sequence scaled_dot_product_attention for prompt chunks (a sequence whose block table is one run
  of blocks is read as a slice of the pool, a fragmented one gathered once per step), and on CPUs without the
  kernel a decode loop of a few tensor ops per sequence.

What each sequence attends over this step is decided once per step (`attention_plan.py`); this module only runs it.
Every path scales the scores by the model's `scale` and, for a soft-capping model (Gemma 2), caps them at
softcap * tanh(scores / softcap) before the softmax, as transformers' eager attention does (SDPA cannot: capped prompt
chunks take explicit matmuls). A layer with attention sinks (gpt-oss: `sinks`, one fp32 logit per query head) has
each head's sink join its softmax's denominator on every path, as transformers' eager attention appends it as one
more column of scores and drops its weight; SDPA cannot either, so such prompt chunks take the explicit matmuls too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from overlap.engine.model.attention_plan import SeqAttention
from overlap.engine.model.helper import HelperThread
from overlap.engine.model.native import DecodeAttentionKernel

# A step's decode attention is shared between threads only from this many decodes on: below it the hand-off costs
# more than the second thread saves.
MIN_DECODES_TO_SHARE = 8


class PagedAttention:
    """q [T, H, D] and one layer's pools [slots, KV, D] -> [T, H * D], by the backend picked for this runner."""

    def __init__(self, *, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 decode_kernel: DecodeAttentionKernel | None, triton, cpu_paths: bool, helper: HelperThread,
                 scale: float | None = None, softcap: float | None = None) -> None:  # fmt: skip
        self.scale = scale or head_dim**-0.5
        self.softcap = softcap
        self.gqa = kv_heads != heads
        self.block_size = block_size
        self.dtype = dtype
        self.decode_kernel = decode_kernel
        self.triton = triton  # the triton_attention module, or None
        self.cpu_paths = cpu_paths
        self.helper = helper

    @property
    def name(self) -> str:
        if self.triton is not None:
            return "Triton paged attention"
        return "native decode attention" if self.decode_kernel is not None else "torch decode attention"

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan,
                 seqs: list[SeqAttention], window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`plan`: the Triton PagedPlan of the whole step, or the native DecodePlan of its decodes (None: no decode
        goes to the kernel); `seqs`: the sequences for torch ops (their plans already hold the window); `sinks`: the
        layer's attention sinks, fp32 [heads] (None: none)."""
        if self.triton is not None:
            out = self.triton.paged_attention(
                q, k_pool, v_pool, plan, self.scale, self.block_size, window, softcap=self.softcap, sinks=sinks
            )
            return out.view(q.shape[0], -1)
        if plan is None:
            return self._torch(q, k_pool, v_pool, seqs, sinks)
        num_tokens, heads, head_dim = q.shape
        out = q.new_empty(num_tokens, heads, head_dim)
        threads = torch.get_num_threads() if self._shares(plan.num_seqs) else 1  # torch's OpenMP threads share them
        self.decode_kernel(q, k_pool, v_pool, plan, out, 0, plan.num_seqs, self.scale, threads, self.softcap, sinks)
        for s in seqs:
            out[s.q_start : s.q_start + s.q_len] = self._sdpa(q, k_pool, v_pool, s, sinks)
        return out.view(num_tokens, -1)

    def _shares(self, num_decodes: int) -> bool:
        """Whether the decodes are shared between threads (the native kernel's OpenMP threads, or the torch path's
        helper thread): not with one intra-op thread configured (the step's halves already run on two threads), nor
        for too few decodes for the hand-off to pay."""
        return torch.get_num_threads() >= 2 and num_decodes >= MIN_DECODES_TO_SHARE

    def _sdpa(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, s: SeqAttention,
              sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """SDPA for one sequence: q [T, H, D] and the slot-major pools [slots, KV, D] -> its rows [q_len, H, D]."""
        if s.kv_start is not None:
            k, v = k_pool[s.kv_start : s.kv_start + s.kv_len], v_pool[s.kv_start : s.kv_start + s.kv_len]
        else:  # gather whole rows (KV * D contiguous values each)
            k, v = k_pool.index_select(0, s.kv_index), v_pool.index_select(0, s.kv_index)
        if self.softcap is not None or sinks is not None:
            return self._eager(q[s.q_start : s.q_start + s.q_len], k, v, s, sinks)
        # Head-major views with a batch dimension of one: with 4-D inputs CPU SDPA takes its flash kernel (3-D ones
        # take the math path, ~30% slower for a 128-token chunk).
        return F.scaled_dot_product_attention(
            q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=s.mask,
            is_causal=s.is_causal,
            scale=self.scale,
            enable_gqa=self.gqa,
        )[0].transpose(0, 1)

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: SeqAttention,
               sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """Soft-capped attention, or attention with sinks, of one sequence as transformers' eager attention computes
        it: q [n, H, D] and its K/V rows [L, KV, D] -> [n, H, D]."""
        group = q.shape[1] // k.shape[1]
        k_h, v_h = (t.transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))  # [H, L, D]
        scores = torch.matmul(q.transpose(0, 1), k_h.transpose(1, 2)) * self.scale  # [H, n, L]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        keep = s.mask
        if s.is_causal:  # a chunk from position 0: query i sees keys 0 .. i
            keep = torch.ones(s.q_len, s.kv_len, dtype=torch.bool, device=q.device).tril()
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1, dtype=torch.float32)
        else:  # the sink as one more column of each head's scores, its weight dropped after the softmax
            column = sinks.view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores.float(), column], dim=-1).softmax(-1)[..., :-1]
        return torch.matmul(probs.to(v.dtype), v_h).transpose(0, 1)

    def _torch(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seqs,
               sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Per-sequence attention reading the pool in place. The path of CUDA without Triton, of CPUs without the
        native kernel, and of prompt chunks everywhere. On CPU a decode (one query) is a few tensor ops, cheaper
        than SDPA's fixed cost per call at this size; the decode loop runs with one intra-op thread per Python
        thread (an OpenMP region per tiny kernel costs more than it saves), the helper taking every other one."""
        num_tokens = q.shape[0]
        if not self.cpu_paths:
            outs = [self._sdpa(q, k_pool, v_pool, s, sinks) for s in seqs]
            return torch.cat(outs).reshape(num_tokens, -1)
        kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
        outs: list[torch.Tensor | None] = [None] * len(seqs)
        decodes = []
        for i, s in enumerate(seqs):
            if s.q_len > 1:
                outs[i] = self._sdpa(q, k_pool, v_pool, s, sinks)  # [n, H, D]
            else:
                decodes.append(i)
        if decodes:
            q_g = (q * self.scale).view(num_tokens, kv_heads, -1, head_dim)  # [T, KV, group, D]
            sinks_g = None if sinks is None else sinks.view(kv_heads, -1)  # [KV, group]
            attend = self._decodes_fp32 if self.dtype == torch.float32 else self._decodes_upcast

            def attend_decodes(indices: list[int]) -> None:
                torch.set_num_threads(1)  # this thread's own OpenMP setting; the global one is 1 meanwhile
                attend(q_g, k_pool, v_pool, seqs, indices, outs, self.softcap, sinks_g)

            threads = torch.get_num_threads()
            share = self._shares(len(decodes))
            torch.set_num_threads(1)
            try:
                if share:
                    future = self.helper.submit(attend_decodes, decodes[1::2])
                    attend_decodes(decodes[0::2])
                    future.result()
                else:
                    attend_decodes(decodes)
            finally:
                torch.set_num_threads(threads)
            if len(decodes) == len(seqs):  # a pure decode step: one stack, no reordering
                return torch.stack(outs).view(num_tokens, -1)
            for i in decodes:
                outs[i] = outs[i].view(1, -1, head_dim)
        return torch.cat(outs).view(num_tokens, -1)

    @staticmethod
    def _decodes_fp32(q_g, k_pool, v_pool, seqs, indices, outs, softcap, sinks) -> None:
        """Multiply-and-sum over the slot-major K/V rows ([L, KV, D], contiguous) instead of two matmuls on
        head-major views: one streaming pass over each (1.5x faster than the matmuls, docs/engine.md)."""
        q_e = q_g.unsqueeze(1)  # [T, 1, KV, group, D]
        for i in indices:
            s = seqs[i]
            if s.kv_start is not None:
                k, v = k_pool[s.kv_start : s.kv_start + s.kv_len], v_pool[s.kv_start : s.kv_start + s.kv_len]
            else:
                k, v = k_pool.index_select(0, s.kv_index), v_pool.index_select(0, s.kv_index)
            scores = (k.unsqueeze(2) * q_e[s.q_start]).sum(-1)  # [L, KV, group]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            # with sinks, each head's sink as one more row of scores, its weight dropped
            probs = scores.softmax(0) if sinks is None else torch.cat([scores, sinks.unsqueeze(0)]).softmax(0)[:-1]
            outs[i] = (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(0)  # [KV, group, D]

    @staticmethod
    def _decodes_upcast(q_g, k_pool, v_pool, seqs, indices, outs, softcap, sinks) -> None:
        """bf16 / fp16: two matmuls over head-major views, the softmax in fp32."""
        k_tt = k_pool.permute(1, 2, 0)  # [KV, D, slots]: K transposed, still a view
        v_t = v_pool.transpose(0, 1)  # [KV, slots, D]
        for i in indices:
            s = seqs[i]
            if s.kv_start is not None:
                k_T, v = k_tt[:, :, s.kv_start : s.kv_start + s.kv_len], v_t[:, s.kv_start : s.kv_start + s.kv_len]
            else:
                k_T = k_pool.index_select(0, s.kv_index).permute(1, 2, 0)
                v = v_pool.index_select(0, s.kv_index).transpose(0, 1)
            scores = torch.matmul(q_g[s.q_start], k_T)  # [KV, group, L]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if sinks is None:
                probs = scores.softmax(-1, dtype=torch.float32)
            else:  # each head's sink as one more column of scores, its weight dropped
                probs = torch.cat([scores.float(), sinks.unsqueeze(-1)], dim=-1).softmax(-1)[..., :-1]
            outs[i] = torch.matmul(probs.to(v.dtype), v)  # [KV, group, D]
