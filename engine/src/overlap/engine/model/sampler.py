"""Pick one token per row of logits: greedy, temperature, top-k, top-p, per-request seeds.

Cost rules (CPU, vocab 8k, batch 64): an all-greedy batch is one argmax. Rows with top-k take `topk` first and do
everything else on those k candidates, so no full-vocabulary sort or multinomial happens for them. Rows without
top-k sample by inverse CDF (softmax, cumsum, searchsorted of one uniform number): one pass over the vocabulary,
no sort unless top-p < 1 asks for one.

Reproducibility: a request with a seed draws its uniform number from a generator seeded with (seed,
num_generated), so the same seed and position give the same token whatever else is in the batch; requests without
a seed draw from the runner's own generator (seeded from EngineConfig.seed).
"""

from __future__ import annotations

import torch

from overlap.engine.model.staging import stage, to_device
from overlap.engine.types import NONFINITE_TOKEN, SamplingParams, TokenLogprob

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, step) pairs over the seed space


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_generated: list[int],
    generator: torch.Generator,
    argmax=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] (any float dtype) -> token ids [S] (int64, on logits' device) and whether each row's logits
    were finite. Sampled in fp32: widening bf16 is exact (the same argmax), and torch's CPU argmax over bf16 is
    several times slower than over fp32. A row's argmax lands on a NaN or +inf if it holds one (and anywhere in a
    row of -inf), so the logit there tells a broken row for the price of one gather instead of another pass.
    `argmax` replaces torch.argmax(logits, -1) (the runner passes the native one on CPU, or Triton's ops' on CUDA);
    it reads the model's dtype as it is, so an all-greedy batch skips the copy to fp32.

    No host sync: every decision (which rows, how many candidates, whether to sort) is made on the host from `params`,
    and the rows' numbers (index, temperature, top-p, top-k, uniform draw) reach the device in one staged copy."""
    greedy = all(p.is_greedy for p in params)
    if argmax is None or not greedy:
        logits = logits.float()
    out = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    finite = torch.isfinite(logits.gather(1, out.unsqueeze(1)).squeeze(1))
    if greedy:
        return out, finite
    vocab = logits.shape[1]
    # Rows with top-k first, then the rest: each group is one slice of the staged table.
    rows = [i for i, p in enumerate(params) if not p.is_greedy and p.top_k > 0]
    num_topk = len(rows)
    rows += [i for i, p in enumerate(params) if not p.is_greedy and p.top_k == 0]
    table = [[i, params[i].temperature, params[i].top_p, min(params[i].top_k, vocab)] for i in rows]
    uniforms = _uniforms([params[i] for i in rows], [num_generated[i] for i in rows], generator)
    staged = stage(torch.cat([torch.tensor(table, dtype=torch.float32), uniforms.unsqueeze(1)], dim=1), logits.device)
    for lo, hi, use_topk in ((0, num_topk, True), (num_topk, len(rows), False)):
        if lo == hi:
            continue
        group = staged[lo:hi]
        idx, temps, top_p, u = group[:, 0].long(), group[:, 1:2], group[:, 2:3], group[:, 4:5]  # the table's columns
        scaled = logits.index_select(0, idx) / temps
        if use_topk:
            values, candidates = scaled.topk(max(t[3] for t in table[lo:hi]), dim=-1)  # sorted, largest first
            ranks = torch.arange(values.shape[1], device=logits.device)
            values = values.masked_fill(ranks.unsqueeze(0) >= group[:, 3:4], float("-inf"))
            picked = _inverse_cdf(values, top_p, u, is_sorted=True)
            tokens = candidates.gather(1, picked.unsqueeze(1)).squeeze(1)
        elif any(t[2] < 1 for t in table[lo:hi]):
            values, candidates = scaled.sort(dim=-1, descending=True)
            picked = _inverse_cdf(values, top_p, u, is_sorted=True)
            tokens = candidates.gather(1, picked.unsqueeze(1)).squeeze(1)
        else:
            tokens = _inverse_cdf(scaled, top_p, u, is_sorted=False)
        out[idx] = tokens
    return out, finite


def verify_proposals(
    tokens: torch.Tensor, finite: torch.Tensor, seq_rows: list[int], spec: list[tuple[int, int, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Speculative decoding's acceptance (`types.accept_proposals`), on the device with no host sync. `tokens` and
    `finite` [R]: what `sample` picked at every sampled row (each row's logits already went through the request's
    controls, temperature, top-k and top-p, so a proposal is accepted with the probability the target gives it
    there); `seq_rows`: each sampled sequence's first row; `spec`: (sequence index, first row, proposals) per
    sequence with proposals. Returns per sampled sequence its last appended token [S] and the same with
    NONFINITE_TOKEN where a row it appends from was not finite, and (accepted counts [G], the sampled tokens of each
    such sequence's rows [G, k_max + 1]) for the host to read."""
    device = tokens.device
    k_max = max(len(drafts) for _, _, drafts in spec)
    padded = [t for _, _, drafts in spec for t in drafts + [-1] * (k_max - len(drafts))]  # -1 matches no token
    seqs_t, firsts_t, seq_rows_t, drafts_t = to_device(
        device, [s for s, _, _ in spec], [r for _, r, _ in spec], seq_rows, padded
    )
    drafts_t = drafts_t.view(len(spec), k_max)
    index = (firsts_t.unsqueeze(1) + torch.arange(k_max + 1, device=device)).clamp_(max=tokens.numel() - 1)
    table = tokens.index_select(0, index.view(-1)).view(len(spec), k_max + 1)
    accepted = (table[:, :k_max] == drafts_t).long().cumprod(dim=1).sum(dim=1)
    last_rows = seq_rows_t.index_copy(0, seqs_t, firsts_t + accepted)
    bad = (~finite).long().cumsum(0)  # non-finite rows up to each row: a sequence's rows are consecutive
    bad_before = bad.index_select(0, seq_rows_t) - (~finite).long().index_select(0, seq_rows_t)
    ok = bad.index_select(0, last_rows) == bad_before
    seq_tokens = tokens.index_select(0, last_rows)
    return seq_tokens, torch.where(ok, seq_tokens, NONFINITE_TOKEN), (accepted, table)


def _inverse_cdf(values: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, is_sorted: bool) -> torch.Tensor:
    """Column index drawn from softmax(values) restricted to the top-p nucleus (values sorted when top_p < 1)."""
    probs = values.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    if is_sorted:
        # Keep the smallest prefix whose mass reaches top_p: a column stays if the mass before it is < top_p.
        keep = (cdf - probs) < top_p
        probs = probs * keep
        cdf = probs.cumsum(dim=-1)
    target = u * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can push the target past the last kept column; clamp to the last column with mass.
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    return torch.minimum(picked, last)


def _uniforms(params: list[SamplingParams], num_generated: list[int], generator: torch.Generator) -> torch.Tensor:
    shared = torch.rand(len(params), generator=generator, dtype=torch.float64)
    for n, (p, step) in enumerate(zip(params, num_generated, strict=True)):
        if p.seed is not None:
            g = torch.Generator().manual_seed(((p.seed * _SEED_MIX) ^ step) & 0xFFFF_FFFF_FFFF_FFFF)
            shared[n] = torch.rand(1, generator=g, dtype=torch.float64)[0]
    return shared.float()


def logprob_tensors(logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor):
    """For the rows whose request asks for logprobs: log_softmax of the raw logits (fp32, before temperature and
    top-k/top-p, as vLLM's default `raw_logprobs`), the sampled token's value and the top-k. Stays on the device;
    None when no row asks, so plain batches pay nothing."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    (idx,) = to_device(logits.device, rows)
    logprobs = logits.index_select(0, idx).float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, idx).view(-1, 1).to(torch.long)).squeeze(1)
    k = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return rows, [params[i].logprobs for i in rows], chosen, top_ids, top_values


def logprob_lists(tensors, num_rows: int) -> list[TokenLogprob | None] | None:
    """`logprob_tensors`' result on the host: a TokenLogprob per sampled row (None for rows that did not ask)."""
    if tensors is None:
        return None
    rows, ks, chosen, top_ids, top_values = tensors
    out: list[TokenLogprob | None] = [None] * num_rows
    ids, values = top_ids.tolist(), top_values.tolist()
    for n, (row, k, value) in enumerate(zip(rows, ks, chosen.tolist(), strict=True)):
        out[row] = TokenLogprob(value, list(zip(ids[n][:k], values[n][:k], strict=True)))
    return out


def apply_logits_controls(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_generated: list[int],
    histories: list[torch.Tensor | None],
    prompts: list[list[int] | None],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """Logit bias, min_tokens, bad words and the three penalties, for the rows whose request sets any (vLLM's order;
    the others pass untouched, and an all-plain batch returns `logits` itself). `histories[i]`: row i's generated
    tokens so far (a device tensor) when its controls need them."""
    rows = [i for i, p in enumerate(params) if p.has_logits_controls]
    if not rows:
        return logits
    # A copy: the raw logits stay as they are for the logprobs.
    logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
    device, vocab = logits.device, logits.shape[1]
    for i in rows:
        p, row, history = params[i], logits[i], histories[i]
        if p.logit_bias:
            (ids,) = to_device(device, [t for t, _ in p.logit_bias])
            (bias,) = to_device(device, [b for _, b in p.logit_bias], dtype=row.dtype)
            row.index_add_(0, ids, bias)
        banned = []
        if num_generated[i] < p.min_tokens:
            banned += [*eos_token_ids, *p.stop_token_ids]
        for word in p.bad_words_ids:
            if len(word) == 1:
                banned.append(word[0])
            elif (  # a host read of the last tokens: multi-token bad words are the one control that syncs
                history is not None
                and history.numel() >= len(word) - 1
                and history[history.numel() - len(word) + 1 :].tolist() == list(word[:-1])  # its prefix just ended
            ):
                banned.append(word[-1])
        if banned:
            row.index_fill_(0, to_device(device, banned)[0], float("-inf"))
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            # counted with index_add_, not bincount: on CUDA bincount reads the max back to size its output
            counts = torch.zeros(vocab, dtype=row.dtype, device=device)
            if history is not None and history.numel():
                counts.index_add_(0, history, torch.ones(history.shape, dtype=row.dtype, device=device))
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                if prompts[i]:
                    seen[to_device(device, prompts[i])[0]] = True
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                # a tiny penalty overflows a positive logit to +inf, which reads as a broken model: saturate it
                penalized.clamp_(max=torch.finfo(row.dtype).max)
                row.copy_(torch.where(seen, penalized, row))
            if p.frequency_penalty:
                row.sub_(counts * p.frequency_penalty)
            if p.presence_penalty:
                row.sub_((counts > 0).to(row.dtype) * p.presence_penalty)
    return logits


def prompt_logprob_lists(logits: torch.Tensor, targets: list[int], spans: list[tuple[str, int, int, int]]) -> dict:
    """Prompt logprobs on the host: request id -> (first scored position, [TokenLogprob, ...]), from the logits of
    the rows that score the next prompt token (`targets`), grouped per request by `spans` (request id, first
    position, count, top-k)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).view(-1, 1)).squeeze(1).tolist()
    k = max(span[3] for span in spans)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = top_values.tolist(), top_ids.tolist()
    result, at = {}, 0
    for request_id, first, count, span_k in spans:
        rows = range(at, at + count)
        result[request_id] = (first, [TokenLogprob(chosen[r], list(zip(ids[r][:span_k], values[r][:span_k],
                                                                       strict=True))) for r in rows])  # fmt: skip
        at += count
    return result
