"""A step's inputs: the scheduled sequences flattened into packed token / position / slot tensors and the attention
plans, on the runner's device.

Prompts are packed without padding: the step's tokens form one [num_tokens, hidden] matrix for the projections and
MLPs; only attention is per sequence. On CPU with 2+ threads a batch may be cut into two halves of about equal work
that run whole forwards on two Python threads (`split_point`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from overlap.engine.model import graphs, native
from overlap.engine.model.attention_plan import AttentionPlan, SeqGeometry, cpu_plan, triton_plan
from overlap.engine.model.staging import to_device
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V go
    # [R] the rows whose logits are sampled: each sampled sequence's last token, and for a sequence with proposals
    # (speculative decoding) the row before its proposals and each proposal's row. The lists below are per sampled
    # row: a proposal's row samples as the sequence's num_generated + j-th token.
    sample_rows: torch.Tensor
    sampling: list[SamplingParams]
    num_generated: list[int]
    request_ids: list[str]  # of the sampled rows, for the per-request token history of penalties
    prompts: list[list[int] | None]  # of the sampled rows: the whole prompt where a repetition penalty needs it
    # Full-attention layers' plan (the Triton plan serves every layer); sliding-window layers', by window, when some
    # sequence reaches past it, or always when they have a pool of their own.
    plan: AttentionPlan = field(default_factory=lambda: AttentionPlan(None, [], None))
    window_plans: dict[int, AttentionPlan] = field(default_factory=dict)
    window_slots: torch.Tensor | None = None  # [T] each token's K/V slot in the sliding layers' own pool, if any
    # CPU with 2+ threads: the batch cut in two halves (consecutive sequences), each run through the whole model by
    # its own Python thread with one intra-op thread; the fields above then describe the first half only.
    halves: tuple[StepInputs, StepInputs] | None = None
    # Prompt logprobs: the rows whose logits score the next prompt token, those tokens, and per request
    # (request id, first scored position, count, top-k); the forward leaves the rows' logits in prompt_logits.
    prompt_rows: torch.Tensor | None = None
    prompt_targets: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None
    # A decode step served by a captured graph: (its packed inputs on the device, the bucket, how many sequences).
    # input_ids, positions and slots are then views of that buffer.
    graph: tuple[torch.Tensor, int, int] | None = None
    # The batch these inputs were packed from: under tensor parallelism rank 0 sends it to the other ranks.
    batch: ModelInput | None = None
    # Speculative decoding, when some sequence has proposals: per such sequence (its index among the sampled
    # sequences, its first sampled row, its proposals); the first sampled row of every sampled sequence; and per
    # sampled row the proposals before it (penalties count them as generated).
    spec: list[tuple[int, int, list[int]]] = field(default_factory=list)
    seq_rows: list[int] = field(default_factory=list)
    row_drafts: list[list[int]] = field(default_factory=list)
    lora: object = None  # the rows of each LoRA adapter (model/lora.py LoraRows); None: every row is the base's
    lora_filled: list = field(default_factory=list)  # the LoRA adapters `batch.lora_loads` filled slots with

    def plan_for(self, window: int | None) -> AttentionPlan:
        """The plan of a layer with this sliding window (None: full attention)."""
        return self.plan if window is None else self.window_plans.get(window, self.plan)

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads on the device (for a stream hand-off: `record_stream`)."""
        tensors = [self.input_ids, self.positions, self.slots, self.sample_rows]
        if self.window_slots is not None:
            tensors.append(self.window_slots)
        for attention_plan in [self.plan, *self.window_plans.values()]:
            last = attention_plan.last_layer
            for plan in [attention_plan.kernel_plan] + ([last[0]] if last else []):
                if plan is not None and not isinstance(plan, native.DecodePlan):  # a Triton PagedPlan
                    tensors += [plan.tables, plan.q_starts, plan.q_lens, plan.kv_lens, plan.prog_seq, plan.prog_q]
            for seq in attention_plan.seqs:
                tensors += [t for t in (seq.kv_index, seq.mask) if t is not None]
        if self.graph is not None:
            tensors.append(self.graph[0])
        return tensors


def decode_graph_inputs(buffer: torch.Tensor, bucket: int, width: int, triton, device: torch.device) -> StepInputs:
    """A captured graph's StepInputs: views of the bucket's static buffer (`graphs.buffer_views`)."""
    ids, positions, slots, kv_lens, tables = graphs.buffer_views(buffer, bucket, width)
    rows = torch.arange(bucket, device=device)
    plan = triton.PagedPlan(tables, rows, torch.ones_like(rows), kv_lens, rows, torch.zeros_like(rows), 1)
    return StepInputs(ids, positions, slots, rows, [], [], [], [], plan=AttentionPlan(plan, [], None))


class InputPacker:
    """Turns a `ModelInput` into `StepInputs` for one runner (its pool, block size, kernels and graphs)."""

    def __init__(self, *, block_size: int, num_kv_blocks: int, max_model_len: int, device: torch.device,
                 windows: list[int], use_decode_kernel: bool, triton, group: int,
                 halves_min_tokens: int | None, num_window_blocks: int | None = None) -> None:  # fmt: skip
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        # The sliding layers' own pool (a model mixing layer types): its usable blocks, ids 1 .. n (0: the null block)
        self.num_window_blocks = num_window_blocks
        self.max_model_len = max_model_len
        self.device = device
        self.windows = windows  # the distinct sliding windows of the model's layers
        self.use_decode_kernel = use_decode_kernel
        self.triton = triton
        self.group = group  # query heads per KV head
        # Steps of at least this many tokens may run as two halves (None: never; the runner's step plan).
        self.halves_min_tokens = halves_min_tokens
        self.graphs: graphs.DecodeGraphs | None = None

    def pack(self, batch: ModelInput) -> StepInputs:
        scores_prompt = any(s.sampling.prompt_logprobs is not None for s in batch.seqs)
        halves = (self.halves_min_tokens is not None and torch.get_num_threads() >= 2 and not scores_prompt
                  and sum(len(s.token_ids) for s in batch.seqs) >= self.halves_min_tokens)  # fmt: skip
        cut = split_point(batch) if halves else None
        if cut is None:
            return self._pack(batch)
        first = self._pack(ModelInput(batch.seqs[:cut]))
        second = self._pack(ModelInput(batch.seqs[cut:]))
        spec, seq_rows, row_drafts = [], [], []
        if first.spec or second.spec:  # the second half's sequences and rows follow the first's
            for half in (first, second):  # a half without proposals: a row per sequence
                if not half.spec:
                    half.seq_rows = list(range(len(half.sampling)))
                    half.row_drafts = [[] for _ in half.sampling]
            num_seqs, num_rows = len(first.seq_rows), len(first.sampling)
            spec = first.spec + [(s + num_seqs, r + num_rows, d) for s, r, d in second.spec]
            seq_rows = first.seq_rows + [r + num_rows for r in second.seq_rows]
            row_drafts = first.row_drafts + second.row_drafts
        return StepInputs(
            input_ids=first.input_ids,
            positions=first.positions,
            slots=first.slots,
            sample_rows=first.sample_rows,
            sampling=first.sampling + second.sampling,
            num_generated=first.num_generated + second.num_generated,
            request_ids=first.request_ids + second.request_ids,
            prompts=first.prompts + second.prompts,
            plan=first.plan,
            halves=(first, second),
            spec=spec,
            seq_rows=seq_rows,
            row_drafts=row_drafts,
        )

    def _pack(self, batch: ModelInput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        geometry: list[SeqGeometry] = []
        window_slots: list[int] = []  # the sliding layers' own pool, when they have one: their slots and geometry
        window_geometry: list[SeqGeometry] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_spans: list[tuple[str, int, int, int]] = []
        spec: list[tuple[int, int, list[int]]] = []
        seq_rows: list[int] = []
        sampled_seqs = []
        for seq in batch.seqs:
            n = len(seq.token_ids)
            start = seq.start_pos
            end = start + n
            if n == 0:
                raise ValueError(f"request {seq.request_id}: scheduled with no tokens")
            if end > self.max_model_len:
                raise ValueError(f"request {seq.request_id}: position {end - 1} is past max_model_len")
            q_start = len(ids)
            ids.extend(seq.token_ids)
            positions.extend(range(start, end))
            if seq.do_sample:
                k = seq.num_draft_tokens
                if k:
                    if not 0 < k < n or seq.sampling.grammar is not None:
                        raise ValueError(f"request {seq.request_id}: {k} proposals in {n} tokens"
                                         + (" with a grammar" if seq.sampling.grammar is not None else ""))  # fmt: skip
                    spec.append((len(seq_rows), len(sample_rows), list(seq.token_ids[n - k :])))
                seq_rows.append(len(sample_rows))
                sample_rows.extend(range(q_start + n - 1 - k, q_start + n))
                sampled_seqs.append(seq)
            if seq.sampling.prompt_logprobs is not None and seq.prompt_token_ids is not None:
                # positions start .. last - 1 of this chunk predict prompt tokens start + 1 .. last
                prompt = seq.prompt_token_ids
                last = min(end, len(prompt) - 1)
                if last > start:
                    prompt_rows.extend(range(q_start, q_start + last - start))
                    prompt_targets.extend(prompt[start + 1 : last + 1])
                    prompt_spans.append((seq.request_id, start + 1, last - start, seq.sampling.prompt_logprobs))
            geometry.append(self._geometry(seq, seq.block_table, self.num_kv_blocks, q_start, slots))
            if self.num_window_blocks is not None:
                # no table of its own (a caller that frees nothing by window: runner-level tests, benchmarks): the full
                # layers' block b is the sliding layers' b + 1, past the null block
                table = seq.window_block_table or [b + 1 for b in seq.block_table]
                window_geometry.append(self._geometry(seq, table, self.num_window_blocks + 1, q_start, window_slots))
        if spec:  # a row per scored position: the sequence's j-th proposal's row samples its num_generated + j + 1-th
            rows = [(s, j) for s in sampled_seqs for j in range(s.num_draft_tokens + 1)]
            sampled = dict(
                sampling=[s.sampling for s, _ in rows],
                num_generated=[s.num_generated + j for s, j in rows],
                request_ids=[s.request_id for s, _ in rows],
                prompts=[s.prompt_token_ids for s, _ in rows],
            )
            row_drafts = [list(s.token_ids[len(s.token_ids) - s.num_draft_tokens :][:j]) for s, j in rows]
            spec_fields = dict(spec=spec, seq_rows=seq_rows, row_drafts=row_drafts)
        else:
            sampled = dict(
                sampling=[s.sampling for s in sampled_seqs],
                num_generated=[s.num_generated for s in sampled_seqs],
                request_ids=[s.request_id for s in sampled_seqs],
                prompts=[s.prompt_token_ids for s in sampled_seqs],
            )
            spec_fields = {}
        bucket = self._graph_bucket(geometry, prompt_rows)
        if bucket is not None:
            decodes = [(ids[g.q_start], positions[g.q_start], slots[g.q_start], g.table) for g in geometry]
            (staged,) = to_device(self.device, self.graphs.pack(decodes, bucket))
            input_ids, positions_t, slots_t, _, _ = graphs.buffer_views(staged, bucket, self.graphs.width)
            # sample_rows: unused, the graph samples its own first rows
            return StepInputs(input_ids, positions_t, slots_t, staged[:0], **sampled,
                              graph=(staged, bucket, len(geometry)))  # fmt: skip
        # Scoring prompt rows, or several rows of a sequence (proposals), needs every row through the last layer: no
        # skipping of unsampled rows then (the last layer's own plan has one query per sequence).
        num_kept = len(ids) if prompt_rows or spec else None
        window_plans = {}
        if self.triton is not None:
            plan = triton_plan(geometry, len(ids), num_kept, triton=self.triton, group=self.group, device=self.device)
            if window_geometry:  # one plan serves every sliding layer: the kernel applies the window itself
                window_plan = triton_plan(window_geometry, len(ids), num_kept, triton=self.triton, group=self.group,
                                          device=self.device)  # fmt: skip
                window_plans = dict.fromkeys(self.windows, window_plan)
        elif window_geometry:
            options = dict(block_size=bs, use_kernel=self.use_decode_kernel, device=self.device)
            plan = cpu_plan(geometry, None, len(ids), num_kept, **options)
            window_plans = {w: cpu_plan(window_geometry, w, len(ids), num_kept, **options) for w in self.windows}
        else:
            options = dict(block_size=bs, use_kernel=self.use_decode_kernel, device=self.device)
            plan = cpu_plan(geometry, None, len(ids), num_kept, **options)
            # A sliding layer needs its own plan only when some sequence reaches past its window; below, it is causal.
            window_plans = {w: cpu_plan(geometry, w, len(ids), num_kept, **options)
                            for w in self.windows if any(g.end > w for g in geometry)}  # fmt: skip
        device = self.device
        input_ids, positions_t, slots_t, sample_rows_t = to_device(device, ids, positions, slots, sample_rows)
        return StepInputs(
            input_ids=input_ids,
            positions=positions_t,
            slots=slots_t,
            sample_rows=sample_rows_t,
            **sampled,
            plan=plan,
            window_plans=window_plans,
            window_slots=to_device(device, window_slots)[0] if window_geometry else None,
            prompt_rows=torch.tensor(prompt_rows, device=device, dtype=torch.long) if prompt_rows else None,
            prompt_targets=prompt_targets,
            prompt_spans=prompt_spans,
            **spec_fields,
        )

    def _geometry(self, seq: ScheduledSeq, block_table: list[int], num_pool_blocks: int, q_start: int,
                  slots: list[int]) -> SeqGeometry:  # fmt: skip
        """Where `seq` sits in a pool of `num_pool_blocks` blocks with this table; its step's slots go on `slots`."""
        bs = self.block_size
        n = len(seq.token_ids)
        start = seq.start_pos
        end = start + n
        num_blocks = -(-end // bs)
        table = block_table[:num_blocks]
        if len(table) < num_blocks:
            raise ValueError(f"request {seq.request_id}: block table covers {len(table) * bs} < {end} positions")
        first = table[0]
        if min(table) < 0 or max(table) >= num_pool_blocks:
            raise ValueError(f"request {seq.request_id}: block table {table} outside the pool of {num_pool_blocks}")
        g = SeqGeometry(q_start, n, start, end, table, seq.do_sample)
        if table[-1] - first == num_blocks - 1 and table == list(range(first, first + num_blocks)):
            g.kv_start = first * bs
            slots.extend(range(g.kv_start + start, g.kv_start + end))
        elif n == 1:  # a decode: its one slot; the whole index only if a torch path reads it
            slots.append(table[start // bs] * bs + start % bs)
        else:
            g.slots = [table[p // bs] * bs + p % bs for p in range(end)]
            slots.extend(g.slots[start:])
        return g

    def _graph_bucket(self, geometry: list[SeqGeometry], prompt_rows: list[int]) -> int | None:
        """The captured bucket for a step of decodes that all sample (None: run it eagerly)."""
        if self.graphs is None or prompt_rows or not all(g.n == 1 and g.do_sample for g in geometry):
            return None
        return self.graphs.bucket_for(len(geometry))


def split_point(batch: ModelInput) -> int | None:
    """Where to cut the batch in two halves of about equal work, or None to run it whole (too small or too lopsided,
    e.g. one long prompt). A token's projections and MLP cost about as much as attending over 150 cached positions at
    decode (tiny Llama, fp32, one thread)."""
    seqs = batch.seqs
    if len(seqs) < 2:
        return None
    costs = [len(s.token_ids) * 150 + len(s.token_ids) * (s.start_pos + len(s.token_ids)) for s in seqs]
    total = sum(costs)
    if total < 150 * 8:  # a few tokens: the thread hand-off costs more than it saves
        return None
    acc, cut = 0, 0
    while cut < len(seqs) - 1 and acc + costs[cut] <= total / 2:
        acc += costs[cut]
        cut += 1
    if cut == 0 or (cut < len(seqs) - 1 and total / 2 - acc > acc + costs[cut] - total / 2):
        acc, cut = acc + costs[cut], cut + 1
    if max(acc, total - acc) > 0.75 * total:
        return None
    return cut
