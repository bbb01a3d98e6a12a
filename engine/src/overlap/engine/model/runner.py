"""The model runner: a batched forward for Llama-family weights over a paged KV pool allocated once.

One step = `prepare()` (CPU: flatten the scheduled sequences into packed token/position/slot tensors and an
attention plan) -> `forward()` (the device: embeddings, layers, logits of the sampled rows) -> `sample()`.
`execute()` runs the three; the overlapped executor may later call them separately.

KV pool layout (per K and V): one tensor [num_layers, num_kv_blocks * block_size, num_kv_heads, head_dim], i.e. a
layer's pool is a flat run of slots, block b holding slots b*bs .. b*bs + bs - 1::

    k_pool[layer]:  | block 0: slot 0..bs-1 | block 1 | block 2 | ... |      slot = table[pos // bs] * bs + pos % bs

Attention reads K/V *in place*. On CPU (fp32 or bf16) the step's decodes (one query token each) go to a small C kernel
(`paged_attention.c`, built on first use by `native.py`) that walks each sequence's block table and streams its K and
V rows once: one call per layer instead of ~5 torch ops per sequence and layer, and at batch 64 about 27% faster than
one batched SDPA over a contiguous cache (`overlap bench engine`). On CUDA every sequence of the step, prompt chunks
included, goes to one Triton kernel per layer (`triton_attention.py`), and decode-only steps replay a CUDA graph
(`graphs.py`). Prompt chunks on CPU, and CPUs without a C compiler, use torch ops: a sequence whose block table is a
run of consecutive block ids (what the block manager hands out where it can) is read as the slice
k_pool[layer][first*bs : first*bs + L]; only a fragmented table is gathered (index_select of its slots, the index
computed once per step and shared by all layers).
Prompts are packed without padding: the step's tokens form one [num_tokens, hidden] matrix for the projections
and MLPs; only attention is per sequence. A prompt row that is not sampled matters to later tokens only through
the K/V it leaves in each layer, so the last layer, past its K/V writes, runs only the sampled rows: its output
projection and MLP are ~12% of a prompt token's projection FLOPs in the tiny model's 6 layers.

CPU fast path (fp32, measured on a 2-core AMD EPYC; batch-64 decode step at context 160 61 -> 21 ms, 2048-token
prefill step 510 -> 230 ms against the first per-sequence-matmul runner): projections through oneDNN with weights
prepacked once (torch's fp32 matmul goes to MKL, AVX2-only on AMD), SiLU fused into the gate matmul, the native
decode-attention kernel, RMSNorm and RoPE with the K/V write as one native call each (`cpu_ops.c`: torch took ~8
kernels per RMSNorm and 5 for RoPE and the two pool writes), and with 2+ threads each step's batch cut into two
halves that run whole forwards on two Python threads with one intra-op thread each. What is left is the projections'
arithmetic and memory traffic: at context 160 a batch-64 decode step reads ~250 MB of fp32 K/V. bf16 takes the same
path (oneDNN's bf16 kernels, a bf16 KV pool, the native kernels summing in fp32 and rounding once, logits widened to
fp32 to sample).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError, ModelLoadError
from overlap.engine.model import graphs, native, sampler
from overlap.engine.model.grammar import GrammarSet
from overlap.engine.model.loader import (
    ModelWeights,
    blocks_for_bytes,
    kv_bytes_per_token,
    load_weights,
    read_spec,
    rope_tables,
)
from overlap.engine.model.loader import random_weights as make_random_weights
from overlap.engine.model.staging import to_device
from overlap.engine.types import NONFINITE_TOKEN, ModelInput, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)
# A step's decode attention is shared with the helper thread only from this many decodes on: below it the hand-off
# costs more than the second thread saves.
MIN_DECODES_TO_SHARE = 8
CPU_KV_BUDGET_BYTES = 1 << 30  # default CPU pool: what max_num_seqs full-length sequences need, at most 1 GiB
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class SeqAttention:
    """How one sequence attends in this step (shared by all layers)."""

    q_start: int  # its rows in the packed token matrix
    q_len: int
    kv_len: int  # attends over positions 0 .. kv_len - 1
    kv_start: int | None  # first slot when its K/V are one run of slots (read as a view)
    kv_index: torch.Tensor | None  # else the slots to gather
    mask: torch.Tensor | None  # bool [q_len, kv_len] for a chunk that does not start at position 0
    is_causal: bool  # a chunk from position 0 (q_len == kv_len): SDPA's own causal mask


@dataclass(slots=True)
class _SeqGeometry:
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


class AttentionPlan(NamedTuple):
    """One layer kind's attention for a step: the kernel's decodes, torch-path sequences, the last layer's plan."""

    decode_plan: native.DecodePlan | None
    seqs: list[SeqAttention]
    last_layer: tuple[native.DecodePlan | None, list[SeqAttention]] | None


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each token's K/V go
    seqs: list[SeqAttention]
    sample_rows: torch.Tensor  # [S] row of each sampled sequence's last token
    sampling: list[SamplingParams]
    num_generated: list[int]
    request_ids: list[str]  # of the sampled rows, for the per-request token history of penalties
    prompts: list[list[int] | None]  # of the sampled rows: the whole prompt where a repetition penalty needs it
    # CPU (fp32 or bf16) with the native kernel: the step's decodes (one query token each), attended by one kernel
    # call per layer; `seqs` then holds only the prompt chunks.
    decode_plan: native.DecodePlan | None = None
    # When some rows are not sampled (prompt chunks): the last layer, past its K/V writes, runs only the sampled rows,
    # each as one query over its whole context, attended like decodes (kernel plan, torch-path sequences). None:
    # every row is sampled.
    last_layer: tuple[native.DecodePlan | None, list[SeqAttention]] | None = None
    # CPU with 2+ threads: the batch cut in two halves (consecutive sequences), each run through the whole model by
    # its own Python thread with one intra-op thread; the fields above then describe the first half only.
    halves: tuple[StepInputs, StepInputs] | None = None
    # Sliding-window layers, by window, when some sequence reaches past it (full-attention plan above otherwise).
    window_plans: dict[int, AttentionPlan] = field(default_factory=dict)
    # Prompt logprobs: the rows whose logits score the next prompt token, those tokens, and per request
    # (request id, first scored position, count, top-k); the forward leaves the rows' logits in prompt_logits.
    prompt_rows: torch.Tensor | None = None
    prompt_targets: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    prompt_logits: torch.Tensor | None = None
    # A decode step served by a captured graph: (its packed inputs on the device, the bucket, how many sequences).
    # input_ids, positions and slots are then views of that buffer.
    graph: tuple[torch.Tensor, int, int] | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors a step reads on the device (for a stream hand-off: `record_stream`)."""
        tensors = [self.input_ids, self.positions, self.slots, self.sample_rows]
        plans = [self.decode_plan] + ([self.last_layer[0]] if self.last_layer else [])
        for plan in plans:
            if plan is not None and not isinstance(plan, native.DecodePlan):  # a Triton PagedPlan
                tensors += [plan.tables, plan.q_starts, plan.q_lens, plan.kv_lens, plan.prog_seq, plan.prog_q]
        for seq in self.seqs:
            tensors += [t for t in (seq.kv_index, seq.mask) if t is not None]
        if self.graph is not None:
            tensors.append(self.graph[0])
        return tensors


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_dir: Path | str, *, cpu_paths: bool = True, random_weights: bool = False
    ) -> None:
        """`cpu_paths=False` runs on CPU the device-generic paths CUDA takes (F.linear, per-sequence SDPA, no native
        kernel, no half-batch threads), so tests cover that branch on a machine without a GPU. `random_weights`
        makes the weights on the device from config.json's shape instead of reading a checkpoint (benchmarks)."""
        self.config = config
        self.model_dir = Path(model_dir)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = _pick_device(config.device)
        self._cpu_paths = self.device.type == "cpu" and cpu_paths
        spec = read_spec(self.model_dir)
        self.spec = spec
        self.dtype = _pick_dtype(config.dtype, spec.torch_dtype, self.device)
        self.attention_backend = _pick_attention(config.attention_backend, self.device, self._cpu_paths)
        # The GPU path: every sequence's attention in one Triton launch per layer (the triton_attention module).
        self._paged = None
        if self.attention_backend == "triton":
            from overlap.engine.model import triton_attention

            self._paged = triton_attention
        self._graphs: graphs.DecodeGraphs | None = None  # captured decode steps (CUDA graphs), see enable_decode_graphs

        self.vocab_size = spec.vocab_size
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.eos_token_id = spec.eos_token_ids[0] if spec.eos_token_ids else None
        self.sampling_defaults = dict(spec.sampling_defaults)
        self.max_model_len = min(config.max_seq_len, spec.max_position_embeddings, spec.rope_context_cap or 1 << 62)
        self.block_size = config.block_size
        self.layer_windows = spec.layer_windows
        self._windows = sorted({w for w in spec.layer_windows if w is not None})

        with torch.inference_mode():
            if random_weights:
                self.weights = make_random_weights(spec, self.dtype, self.device, config.seed)
            else:
                self.weights = load_weights(spec, self.model_dir, self.dtype, self.device)
            cos, sin = rope_tables(spec, self.max_model_len, self.model_dir)
            if cos.shape[1] < spec.head_dim:  # partial rotary: the passed-through dims get angle 0
                order, (cos, sin) = _partial_rotary_order(spec.head_dim, cos.shape[1]), _pad_rotary(cos, sin, spec)
                self.weights = _permute_qk_dims(self.weights, spec, order)
            self.rope_cos = cos.to(self.device, self.dtype)
            half = spec.head_dim // 2
            self.rope_sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(self.device, self.dtype)
            self.num_kv_blocks = self._size_kv_pool()
            # With Triton, one spare block past the usable ones: a CUDA graph's padding rows write and read it.
            pool_blocks = self.num_kv_blocks + (self._paged is not None)
            shape = (spec.num_layers, pool_blocks * self.block_size, spec.num_kv_heads, spec.head_dim)
            # torch.empty: on CPU the pages are committed only when written; nothing reads a slot before it is
            # written (a sequence attends only to its own computed positions).
            self.k_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.v_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._q_size = spec.num_heads * spec.head_dim
        self._kv_size = spec.num_kv_heads * spec.head_dim
        self._gqa = spec.num_kv_heads != spec.num_heads
        self._scale = spec.head_dim**-0.5
        self._helper = None  # a thread for decode attention, made on first use
        # Decode attention in one native call per layer (fp32 or bf16 on CPU); None: per-sequence torch ops.
        self._decode_kernel = None
        if self.attention_backend == "native" and self.dtype in native.DecodeAttentionKernel.DTYPES:
            self._decode_kernel = native.decode_attention_kernel()
        self._linear = _pick_linear(self.device, self.dtype) if self._cpu_paths else F.linear
        if self._linear is not F.linear:
            with torch.inference_mode():
                self.weights = _prepack_for_onednn(self.weights)
        # RMSNorm, RoPE with the K/V write, and greedy argmax as one native call each (CPU fast paths); None: torch.
        self._cpu_ops = None
        if self._cpu_paths and self.dtype in native.DecodeAttentionKernel.DTYPES:
            self._cpu_ops = native.cpu_ops()
        self.last_forward_s: float | None = None  # wall time of the last forward + sampling (device busy time)
        self._histories: dict[str, list[torch.Tensor]] = {}  # request id -> its sampled tokens (penalties)
        self._grammars = GrammarSet(self.model_dir, spec.vocab_size, self.eos_token_ids)  # structured outputs
        # The last execute()'s TokenLogprob per sampled row (None: nobody asked), and its prompt logprobs by request.
        self.last_logprobs: list | None = None
        self.last_prompt_logprobs: dict | None = None
        self.last_busy_interval: tuple[float, float] | None = None  # its (start, end) in time.perf_counter()
        if self.device.type == "cuda" and self._paged is not None and config.cuda_graphs:
            self.enable_decode_graphs(graphs.cuda_capture(self.device))

    def enable_decode_graphs(self, capture, limit: int | None = None) -> None:
        """Capture the decode forward for every bucket up to `limit` (default: the largest max_num_seqs the pool
        allows, so live retuning never captures again). `capture(fn) -> replay` is `graphs.cuda_capture` on CUDA;
        tests pass one that runs eagerly."""
        if self._paged is None or self._cpu_paths:
            raise ConfigError("decode graphs need the Triton attention backend on the device paths")
        width = -(-self.max_model_len // self.block_size)
        spec = self.spec

        def make_inputs(buffer: torch.Tensor, bucket: int) -> StepInputs:
            ids, positions, slots, kv_lens, tables = graphs.buffer_views(buffer, bucket, width)
            rows = torch.arange(bucket, device=self.device)
            plan = self._paged.PagedPlan(tables, rows, torch.ones_like(rows), kv_lens, rows, torch.zeros_like(rows), 1)
            return StepInputs(ids, positions, slots, [], rows, [], [], [], [], decode_plan=plan)

        with torch.inference_mode():
            self._graphs = graphs.DecodeGraphs(
                graphs.decode_buckets(limit or self.num_kv_blocks), width, self.num_kv_blocks, self.block_size,
                spec.vocab_size, self.device, self.dtype, make_inputs, self._forward, capture,
            )  # fmt: skip

    @property
    def graph_steps(self) -> int:
        """Steps served by a captured graph so far (0 without graphs)."""
        return 0 if self._graphs is None else self._graphs.replayed

    def to_device(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """int64 tensors on the runner's device without blocking the host (`staging.to_device`)."""
        return to_device(self.device, *lists)

    @property
    def kernels(self) -> str:
        """What runs the step's work on this machine, for start-up logs and benchmarks."""
        dtype = str(self.dtype).removeprefix("torch.")
        attention = "torch decode attention"
        if self._paged is not None:
            attention = "Triton paged attention"
        elif self._decode_kernel is not None:
            attention = "native decode attention"
        if self.device.type != "cpu":
            return f"{self.device.type} {dtype}: torch linear; {attention}"
        linear = "oneDNN linear, weights prepacked" if self._linear is not F.linear else "torch linear"
        norms = "native RMSNorm, RoPE, argmax" if self._cpu_ops is not None else "torch RMSNorm, RoPE, argmax"
        isa = f"torch {torch.backends.cpu.get_cpu_capability()}"
        return f"CPU {native.cpu_isa()} {dtype}: {linear}; {attention}; {norms}; {isa}"

    # Names the engine and executor read.
    @property
    def last_forward_time_s(self) -> float | None:
        return self.last_forward_s

    def close(self) -> None:
        """Stop the decode-attention helper thread (the KV pool and weights go with the object)."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def _size_kv_pool(self) -> int:
        per_token = kv_bytes_per_token(self.spec, self.dtype)
        min_blocks = -(-self.max_model_len // self.block_size)  # one full-length sequence must fit
        if self.config.num_kv_blocks is not None:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = blocks_for_bytes(free * self.config.kv_cache_ratio, self.block_size, per_token)
        else:
            wanted = -(-self.config.max_num_seqs * self.max_model_len // self.block_size)
            blocks = min(wanted, blocks_for_bytes(CPU_KV_BUDGET_BYTES, self.block_size, per_token))
            blocks = max(blocks, min_blocks)
        if blocks < min_blocks:
            raise ConfigError(
                f"the KV pool holds {blocks} blocks of {self.block_size} tokens, fewer than one sequence of "
                f"max_seq_len {self.max_model_len} needs ({min_blocks}); raise num_kv_blocks/kv_cache_ratio "
                f"or lower max_seq_len"
            )
        return blocks

    # ---- one step ---------------------------------------------------------------------------------------------
    def execute(self, batch: ModelInput) -> list[int]:
        """Run one step; returns one sampled token per sequence with do_sample, in order."""
        inputs = self.prepare(batch)
        start = time.perf_counter()
        threads = torch.get_num_threads()
        try:
            with torch.inference_mode():
                if inputs.halves is not None:
                    # Sample on one thread too: the first OpenMP region after going back to 2 threads pays for
                    # waking the team (batch-64 greedy sampling measured 2.9 ms that way, 0.4 ms on one thread).
                    torch.set_num_threads(1)
                logits = self.forward(inputs)
                sampled, finite = self.sample(logits, inputs)
                self.record_sampled(inputs, sampled)
                logprobs = self.logprob_tensors(logits, inputs, sampled)
                tokens = torch.where(finite, sampled, NONFINITE_TOKEN).tolist()  # .tolist() waits for the device
                self.last_logprobs = self.logprob_lists(logprobs, len(tokens))
                self.last_prompt_logprobs = self.prompt_logprob_lists(inputs)
        finally:
            torch.set_num_threads(threads)
        end = time.perf_counter()
        self.last_forward_s = end - start
        self.last_busy_interval = (start, end)
        return tokens

    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """Logits [num sampled seqs, vocab] in fp32 (tests compare them with transformers)."""
        with torch.inference_mode():
            return self.forward(self.prepare(batch)).float()

    def prepare(self, batch: ModelInput) -> StepInputs:
        scores_prompt = any(s.sampling.prompt_logprobs is not None for s in batch.seqs)
        halves = self._cpu_paths and torch.get_num_threads() >= 2 and not scores_prompt
        cut = self._split_point(batch) if halves else None
        if cut is None:
            return self._prepare(batch)
        first = self._prepare(ModelInput(batch.seqs[:cut]))
        second = self._prepare(ModelInput(batch.seqs[cut:]))
        return StepInputs(
            input_ids=first.input_ids,
            positions=first.positions,
            slots=first.slots,
            seqs=first.seqs,
            sample_rows=first.sample_rows,
            sampling=first.sampling + second.sampling,
            num_generated=first.num_generated + second.num_generated,
            request_ids=first.request_ids + second.request_ids,
            prompts=first.prompts + second.prompts,
            halves=(first, second),
        )

    @staticmethod
    def _split_point(batch: ModelInput) -> int | None:
        """Where to cut the batch in two halves of about equal work, or None to run it whole (too small or too
        lopsided, e.g. one long prompt). A token's projections and MLP cost about as much as attending over 150
        cached positions at decode (tiny Llama, fp32, one thread)."""
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

    def _prepare(self, batch: ModelInput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        geometry: list[_SeqGeometry] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_spans: list[tuple[str, int, int, int]] = []
        for seq in batch.seqs:
            n = len(seq.token_ids)
            start = seq.start_pos
            end = start + n
            if n == 0:
                raise ValueError(f"request {seq.request_id}: scheduled with no tokens")
            if end > self.max_model_len:
                raise ValueError(f"request {seq.request_id}: position {end - 1} is past max_model_len")
            num_blocks = -(-end // bs)
            table = seq.block_table[:num_blocks]
            if len(table) < num_blocks:
                raise ValueError(f"request {seq.request_id}: block table covers {len(table) * bs} < {end} positions")
            first = table[0]
            if first < 0 or max(table) >= self.num_kv_blocks:
                raise ValueError(
                    f"request {seq.request_id}: block table {table} outside the pool of {self.num_kv_blocks}"
                )
            q_start = len(ids)
            ids.extend(seq.token_ids)
            positions.extend(range(start, end))
            if seq.do_sample:
                sample_rows.append(q_start + n - 1)
            if seq.sampling.prompt_logprobs is not None and seq.prompt_token_ids is not None:
                # positions start .. last - 1 of this chunk predict prompt tokens start + 1 .. last
                prompt = seq.prompt_token_ids
                last = min(end, len(prompt) - 1)
                if last > start:
                    prompt_rows.extend(range(q_start, q_start + last - start))
                    prompt_targets.extend(prompt[start + 1 : last + 1])
                    prompt_spans.append((seq.request_id, start + 1, last - start, seq.sampling.prompt_logprobs))
            g = _SeqGeometry(q_start, n, start, end, table, seq.do_sample)
            if table[-1] - first == num_blocks - 1 and table == list(range(first, first + num_blocks)):
                g.kv_start = first * bs
                slots.extend(range(g.kv_start + start, g.kv_start + end))
            elif n == 1:  # a decode: its one slot; the whole index only if a torch path reads it (_kv_index)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                g.slots = [table[p // bs] * bs + p % bs for p in range(end)]
                slots.extend(g.slots[start:])
            geometry.append(g)
        sampled = dict(
            sampling=[s.sampling for s in batch.seqs if s.do_sample],
            num_generated=[s.num_generated for s in batch.seqs if s.do_sample],
            request_ids=[s.request_id for s in batch.seqs if s.do_sample],
            prompts=[s.prompt_token_ids for s in batch.seqs if s.do_sample],
        )
        bucket = self._graph_bucket(geometry, prompt_rows)
        if bucket is not None:
            decodes = [(ids[g.q_start], positions[g.q_start], slots[g.q_start], g.table) for g in geometry]
            (staged,) = to_device(self.device, self._graphs.pack(decodes, bucket))
            input_ids, positions_t, slots_t, _, _ = graphs.buffer_views(staged, bucket, self._graphs.width)
            # sample_rows: unused, the graph samples its own first rows
            return StepInputs(input_ids, positions_t, slots_t, [], staged[:0], **sampled,
                              graph=(staged, bucket, len(geometry)))  # fmt: skip
        # Scoring prompt rows needs every row through the last layer: no skipping of unsampled rows then.
        num_kept = len(ids) if prompt_rows else None
        window_plans = {}
        if self._paged is not None:  # one plan serves every layer: the kernel applies each layer's window itself
            plan = self._paged_plan(geometry, len(ids), num_kept)
        else:
            plan = self._attention_plan(geometry, None, len(ids), num_kept)
            # A sliding layer needs its own plan only when some sequence reaches past its window; below, it is causal.
            window_plans = {w: self._attention_plan(geometry, w, len(ids), num_kept)
                            for w in self._windows if any(g.end > w for g in geometry)}  # fmt: skip
        device = self.device
        input_ids, positions_t, slots_t, sample_rows_t = to_device(device, ids, positions, slots, sample_rows)
        return StepInputs(
            input_ids=input_ids,
            positions=positions_t,
            slots=slots_t,
            seqs=plan.seqs,
            sample_rows=sample_rows_t,
            **sampled,
            decode_plan=plan.decode_plan,
            last_layer=plan.last_layer,
            window_plans=window_plans,
            prompt_rows=torch.tensor(prompt_rows, device=device, dtype=torch.long) if prompt_rows else None,
            prompt_targets=prompt_targets,
            prompt_spans=prompt_spans,
        )

    def _attention_plan(
        self, geometry: list[_SeqGeometry], window: int | None, num_tokens: int, num_kept: int | None = None
    ) -> AttentionPlan:
        """How each sequence attends in a layer with this sliding window (None: full causal attention). A query at
        position p sees keys p - window < k <= p, as in transformers' sliding-window mask."""
        bs, use_kernel = self.block_size, self._decode_kernel is not None
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
                    q_pos = torch.arange(g.start, g.end, device=self.device)[:, None]
                    k_pos = torch.arange(lo, g.end, device=self.device)[None, :]
                    mask = k_pos <= q_pos
                    if window is not None:
                        mask &= k_pos > q_pos - window
            seqs.append(self._seq_attention(g, g.q_start, g.n, lo, mask, is_causal))
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
                    torch_seqs.append(self._seq_attention(g, i, 1, lo, None, False))
            last_plan = None
            if kernel_rows:
                last_plan = native.DecodePlan([g.table for g, _ in kernel_rows], [g.end for g, _ in kernel_rows],
                                              [i for _, i in kernel_rows], bs)  # fmt: skip
            last_layer = (last_plan, torch_seqs)
        decode_plan = native.DecodePlan(tables, lens, rows, bs) if tables else None
        return AttentionPlan(decode_plan, seqs, last_layer)

    def _graph_bucket(self, geometry: list[_SeqGeometry], prompt_rows: list[int]) -> int | None:
        """The captured bucket for a step of decodes that all sample (None: run it eagerly)."""
        if self._graphs is None or prompt_rows or not all(g.n == 1 and g.do_sample for g in geometry):
            return None
        return self._graphs.bucket_for(len(geometry))

    def _paged_plan(self, geometry: list[_SeqGeometry], num_tokens: int, num_kept: int | None) -> AttentionPlan:
        """The Triton kernel's plans: every sequence of the step, and (when some rows are not sampled) the last
        layer's, one query per sampled sequence at its last position."""
        build, group = self._paged.build_plan, self.spec.num_heads // self.spec.num_kv_heads
        plan = build([g.table for g in geometry], [g.q_start for g in geometry], [g.n for g in geometry],
                     [g.end for g in geometry], group, self.device)  # fmt: skip
        sampled = [g for g in geometry if g.do_sample]
        last_layer = None
        if num_kept is None and len(sampled) < num_tokens:
            last = build([g.table for g in sampled], list(range(len(sampled))), [1] * len(sampled),
                         [g.end for g in sampled], group, self.device)  # fmt: skip
            last_layer = (last, [])
        return AttentionPlan(plan, [], last_layer)

    def _seq_attention(self, g: _SeqGeometry, q_start: int, q_len: int, lo: int, mask, is_causal: bool) -> SeqAttention:
        """Sequence g's queries (rows q_start .. q_start + q_len - 1) attending over its positions lo .. end - 1."""
        if g.kv_start is not None:
            return SeqAttention(q_start, q_len, g.end - lo, g.kv_start + lo, None, mask, is_causal)
        if g.index is None:
            slots = g.slots or [g.table[p // self.block_size] * self.block_size + p % self.block_size
                                for p in range(g.end)]  # fmt: skip
            g.index = torch.tensor(slots, device=self.device)
        return SeqAttention(q_start, q_len, g.end - lo, None, g.index[lo:], mask, is_causal)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [num sampled seqs, vocab] (model dtype). Writes the step's K/V into the pool.

        A batch prepared in two halves runs as two independent forwards, one per Python thread with one intra-op
        thread each (torch releases the GIL inside kernels). At decode this beats one forward with 2 OpenMP threads
        by ~20% (batch 64: 2 threads made the [64, 512] x [512, N] matmuls only ~1.2x faster than one thread,
        while each half keeps one core busy with no barrier per kernel); prefill chunks gain ~5%. The halves write
        disjoint KV slots."""
        if inputs.graph is not None:
            return self._graphs.run(*inputs.graph)
        if inputs.halves is None:
            return self._forward(inputs)
        first, second = inputs.halves
        threads = torch.get_num_threads()  # 1 when called from execute()

        def run_half(half: StepInputs) -> torch.Tensor:
            torch.set_num_threads(1)  # this thread's own OpenMP setting
            with torch.inference_mode():
                return self._forward(half)

        torch.set_num_threads(1)
        try:
            future = self._helper_pool().submit(run_half, second)
            logits = self._forward(first)
            return torch.cat([logits, future.result()])
        finally:
            torch.set_num_threads(threads)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        spec, w, linear = self.spec, self.weights, self._linear
        eps, hidden = spec.rms_norm_eps, (spec.hidden_size,)
        num_tokens = inputs.input_ids.shape[0]
        q_size, kv_size, inter = self._q_size, self._kv_size, spec.intermediate_size
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        ops = self._cpu_ops
        if ops is None:
            cos = self.rope_cos.index_select(0, inputs.positions).unsqueeze(1)  # [T, 1, D]
            sin = self.rope_sin_signed.index_select(0, inputs.positions).unsqueeze(1)

        def norm(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(t, hidden, weight, eps) if ops is None else ops.rms_norm(t, weight, eps)

        x = w.embed.index_select(0, inputs.input_ids)
        last = len(w.layers) - 1
        for layer, lw in enumerate(w.layers):
            h = norm(x, lw.input_norm)
            qkv = linear(h, lw.qkv, lw.qkv_bias)
            if lw.q_norm is not None:  # Qwen3: RMSNorm over each head's q and k, before RoPE (in place in qkv)
                q_heads = qkv[:, :q_size].view(num_tokens, heads, head_dim)
                k_heads = qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim)
                q_heads.copy_(F.rms_norm(q_heads, (head_dim,), lw.q_norm, eps))
                k_heads.copy_(F.rms_norm(k_heads, (head_dim,), lw.k_norm, eps))
            k_pool, v_pool = self.k_pool[layer], self.v_pool[layer]
            if ops is not None:
                ops.rope_store_kv(qkv, inputs.positions, self.rope_cos, self.rope_sin_signed, inputs.slots, k_pool,
                                  v_pool, heads)  # fmt: skip
                q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
            else:
                # RoPE on q and k in one go: x * cos + rotate_half(x) * sin, rotate_half as the two halves swapped
                # with the sign folded into sin (three elementwise kernels, not ten). The swap is a cat of the two
                # halves, not flip(): CPU flip is a slow generic kernel (1024 tokens x 16 heads, one thread: the RoPE
                # took 2.0 ms with flip, 0.5 ms with cat; same values).
                qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, 2, head_dim // 2)
                swapped = torch.cat([qk[:, :, 1:], qk[:, :, :1]], dim=2).view(num_tokens, -1, head_dim)
                qk = torch.addcmul(qk.view(num_tokens, -1, head_dim) * cos, swapped, sin)
                q, k = qk[:, :heads], qk[:, heads:]
                v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
                k_pool.index_copy_(0, inputs.slots, k)
                v_pool.index_copy_(0, inputs.slots, v)
            window = self.layer_windows[layer]
            plan = inputs.window_plans.get(window) if window is not None else None
            decode_plan, seqs, last_plan = plan or (inputs.decode_plan, inputs.seqs, inputs.last_layer)
            if layer == last and last_plan is not None:
                # Past its K/V, the last layer only feeds the logits: skip the rows nobody samples (every token of a
                # prompt chunk but the last one, and all of a non-final chunk).
                if inputs.sample_rows.numel() == 0:
                    return x.new_empty(0, spec.vocab_size)
                q, x = q.index_select(0, inputs.sample_rows), x.index_select(0, inputs.sample_rows)
                attn = self._attention(q, k_pool, v_pool, *last_plan, window)
            else:
                attn = self._attention(q, k_pool, v_pool, decode_plan, seqs, window)
            x = linear(attn, lw.o, lw.o_bias).add_(x)  # the residual added in place into the projection's fresh output
            h = norm(x, lw.post_norm)
            if lw.gate_up is None:  # oneDNN: SiLU as the gate matmul's post-op, no separate pass
                act = linear(h, lw.gate, lw.gate_bias, post_op="swish").mul_(linear(h, lw.up, lw.up_bias))
            else:
                gate_up = linear(h, lw.gate_up, lw.gate_up_bias)
                act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            x = linear(act, lw.down, lw.down_bias).add_(x)
        if inputs.last_layer is None:  # every row went through; else x holds the sampled rows already
            if inputs.prompt_rows is not None:
                prompt_x = norm(x.index_select(0, inputs.prompt_rows), w.norm)
                inputs.prompt_logits = linear(prompt_x, w.lm_head)
            x = x.index_select(0, inputs.sample_rows)
        return linear(norm(x, w.norm), w.lm_head)

    def _attention(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        plan,
        seqs: list[SeqAttention],
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] -> [T, H * D]: the Triton kernel for the whole step (`plan` a PagedPlan), or the native kernel
        for the decodes in `plan` (a DecodePlan) and torch ops for `seqs` (their plans already hold the window)."""
        if self._paged is not None:
            out = self._paged.paged_attention(q, k_pool, v_pool, plan, self._scale, self.block_size, window)
            return out.view(q.shape[0], -1)
        if plan is None:
            return self._attention_torch(q, k_pool, v_pool, seqs)
        num_tokens, heads, head_dim = q.shape
        out = q.new_empty(num_tokens, heads, head_dim)
        kernel = self._decode_kernel
        helper = self._decode_helper(plan.num_seqs)
        if helper is not None:  # a batch run whole: the helper thread takes half the context
            future = helper.submit(kernel, q, k_pool, v_pool, plan, out, plan.mid, plan.num_seqs, self._scale)
            kernel(q, k_pool, v_pool, plan, out, 0, plan.mid, self._scale)
            future.result()
        else:
            kernel(q, k_pool, v_pool, plan, out, 0, plan.num_seqs, self._scale)
        for s in seqs:
            out[s.q_start : s.q_start + s.q_len] = self._attend(q, k_pool, v_pool, s)
        return out.view(num_tokens, -1)

    def _attention_torch(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seqs) -> torch.Tensor:
        """Per-sequence attention reading the pool in place: no K/V copy for a sequence whose blocks form one run.
        q [T, H, D] -> [T, H * D].

        The path of CUDA, of CPUs without the native kernel, and of prompt chunks everywhere (they use
        scaled_dot_product_attention).
        On CPU a decode (one query) is six tensor ops: its query, two pool slices, matmul, softmax, matmul. SDPA's
        fixed cost per call is larger than the work at this size (batch 64, context 160, one thread: 4.0 ms per layer
        with SDPA, 3.0 ms with the matmuls, 2.5 ms for one batched SDPA over a contiguous cache). The decode loop runs
        with one intra-op thread per Python thread, because an OpenMP region per tiny kernel costs more than it saves;
        with 2+ threads configured, a helper thread takes every other sequence (with the oneDNN projections, paged
        decode on this path measured 23% slower than the contiguous cache at batch 64)."""
        num_tokens = q.shape[0]
        if not self._cpu_paths:
            outs = [self._attend(q, k_pool, v_pool, s) for s in seqs]
            return torch.cat(outs).reshape(num_tokens, -1)
        kv_heads, head_dim = k_pool.shape[1], k_pool.shape[2]
        outs: list[torch.Tensor | None] = [None] * len(seqs)
        decodes = []
        v_t = v_pool.transpose(0, 1)  # [KV, slots, D]
        for i, s in enumerate(seqs):
            if s.q_len > 1:
                outs[i] = self._attend(q, k_pool, v_pool, s)  # [n, H, D]
            else:
                decodes.append(i)
        if decodes:
            q_g = (q * self._scale).view(num_tokens, kv_heads, -1, head_dim)  # [T, KV, group, D]
            k_tt = k_pool.permute(1, 2, 0)  # [KV, D, slots]: K transposed, still a view
            upcast = self.dtype != torch.float32

            def attend_decodes(indices: list[int]) -> None:
                torch.set_num_threads(1)  # this thread's own OpenMP setting; the global one is 1 meanwhile
                if not upcast:
                    attend_decodes_fp32(indices)
                    return
                for i in indices:
                    s = seqs[i]
                    if s.kv_start is not None:
                        k_T = k_tt[:, :, s.kv_start : s.kv_start + s.kv_len]
                        v = v_t[:, s.kv_start : s.kv_start + s.kv_len]
                    else:
                        k_T = k_pool.index_select(0, s.kv_index).permute(1, 2, 0)
                        v = v_pool.index_select(0, s.kv_index).transpose(0, 1)
                    scores = torch.matmul(q_g[s.q_start], k_T)  # [KV, group, L]
                    probs = scores.softmax(-1, dtype=torch.float32).to(v.dtype) if upcast else scores.softmax(-1)
                    outs[i] = torch.matmul(probs, v)  # [KV, group, D]

            q_e = q_g.unsqueeze(1)  # [T, 1, KV, group, D]

            def attend_decodes_fp32(indices: list[int]) -> None:
                # Multiply-and-sum over the slot-major K/V rows ([L, KV, D], contiguous) instead of two matmuls on
                # head-major views: one streaming pass over each, 1.5x faster (32 sequences x 160 positions x 6
                # layers, one thread: 10.0 ms vs 15.2 ms; a batched SDPA over a strided view took 12.3 ms).
                for i in indices:
                    s = seqs[i]
                    if s.kv_start is not None:
                        k = k_pool[s.kv_start : s.kv_start + s.kv_len]
                        v = v_pool[s.kv_start : s.kv_start + s.kv_len]
                    else:
                        k, v = k_pool.index_select(0, s.kv_index), v_pool.index_select(0, s.kv_index)
                    probs = (k.unsqueeze(2) * q_e[s.q_start]).sum(-1).softmax(0)  # [L, KV, group]
                    outs[i] = (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(0)  # [KV, group, D]

            threads = torch.get_num_threads()
            # Attention at decode is bound by reading K/V; a second thread doubles the bandwidth in use. Python
            # threads, not OpenMP: torch releases the GIL inside each kernel, and no barrier per kernel.
            helper = self._decode_helper(len(decodes))
            torch.set_num_threads(1)
            try:
                if helper is None:
                    attend_decodes(decodes)
                else:
                    future = helper.submit(attend_decodes, decodes[1::2])
                    attend_decodes(decodes[0::2])
                    future.result()
            finally:
                torch.set_num_threads(threads)
            if len(decodes) == len(seqs):  # a pure decode step: one stack, no reordering
                return torch.stack(outs).view(num_tokens, -1)
            for i in decodes:
                outs[i] = outs[i].view(1, -1, head_dim)
        return torch.cat(outs).view(num_tokens, -1)

    def _decode_helper(self, num_decodes: int):
        """The helper thread that takes half of a step's decode attention, or None: one intra-op thread configured
        (the step's halves already run on two threads), or too few decodes for the hand-off to pay."""
        if torch.get_num_threads() < 2 or num_decodes < MIN_DECODES_TO_SHARE:
            return None
        return self._helper_pool()

    def _helper_pool(self):
        """The one helper thread (a half-batch forward, or every other decode's attention), made on first use."""
        if self._helper is None:
            from concurrent.futures import ThreadPoolExecutor

            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-attn")
        return self._helper

    def _attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, s: SeqAttention) -> torch.Tensor:
        """SDPA for one sequence: q [T, H, D] and the slot-major pools [slots, KV, D] -> its rows [q_len, H, D]."""
        if s.kv_start is not None:
            k, v = k_pool[s.kv_start : s.kv_start + s.kv_len], v_pool[s.kv_start : s.kv_start + s.kv_len]
        else:  # gather whole rows (KV * D contiguous values each)
            k, v = k_pool.index_select(0, s.kv_index), v_pool.index_select(0, s.kv_index)
        # Head-major views with a batch dimension of one: with 4-D inputs CPU SDPA takes its flash kernel (3-D ones
        # take the math path, ~30% slower for a 128-token chunk).
        return F.scaled_dot_product_attention(
            q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=s.mask,
            is_causal=s.is_causal,
            enable_gqa=self._gqa,
        )[0].transpose(0, 1)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [S] and their rows' finiteness (`sampler.sample`) from the raw logits: the logits controls
        first (penalties, bias, ...), for the rows that set any."""
        if any(p.has_logits_controls for p in inputs.sampling):
            rows = list(zip(inputs.request_ids, inputs.num_generated, inputs.sampling, strict=True))
            histories = [self._history_of(rid, n) if p.needs_history else None for rid, n, p in rows]
            logits = sampler.apply_logits_controls(logits, inputs.sampling, inputs.num_generated, histories,
                                                   inputs.prompts, self.eos_token_ids)  # fmt: skip
            grammar_rows = [(row, rid, n) for row, (rid, n, p) in enumerate(rows) if p.grammar is not None]
            if grammar_rows:  # structured outputs: what the grammar does not allow next gets -inf
                self._grammars.mask(logits, grammar_rows)
        argmax = None if self._cpu_ops is None else self._cpu_ops.argmax
        return sampler.sample(logits, inputs.sampling, inputs.num_generated, self.generator, argmax)

    def record_sampled(self, inputs: StepInputs, tokens: torch.Tensor) -> None:
        """Keep the tokens of requests whose controls need their history, on the device (no host sync). Indexed by
        position: a step whose tokens the engine dropped (a preemption) is overwritten when the position is
        sampled again."""
        host_tokens = None
        for row, (rid, n, p) in enumerate(zip(inputs.request_ids, inputs.num_generated, inputs.sampling, strict=True)):
            if p.needs_history:
                history = self._histories.setdefault(rid, [])
                del history[n:]
                history.append(tokens[row : row + 1])
            if p.grammar is not None:  # the matcher runs on the host: this reads the step's tokens back
                host_tokens = tokens.tolist() if host_tokens is None else host_tokens
                self._grammars.advance(rid, host_tokens[row])

    def _history_of(self, request_id: str, num_generated: int) -> torch.Tensor:
        history = self._histories.get(request_id, [])[:num_generated]
        if not history:
            return torch.empty(0, dtype=torch.long, device=self.device)
        return torch.cat(history).to(torch.long)

    def forget_request(self, request_id: str) -> None:
        """A finished request's token history and grammar go (the executors call this when it leaves the
        pipeline)."""
        self._histories.pop(request_id, None)
        self._grammars.forget(request_id)

    def add_grammar(self, request_id: str, grammar: str) -> None:
        """Build a request's grammar matcher before it is scheduled; InvalidRequestError for a bad grammar."""
        self._grammars.add(request_id, grammar)

    @staticmethod
    def logprob_tensors(logits: torch.Tensor, inputs: StepInputs, tokens: torch.Tensor):
        """Device-side logprobs of the rows whose request asks (None when none does); see `sampler`."""
        return sampler.logprob_tensors(logits, inputs.sampling, tokens)

    @staticmethod
    def prompt_logprob_lists(inputs: StepInputs) -> dict | None:
        """The step's prompt logprobs: request id -> (first scored position, [TokenLogprob, ...]); None if none."""
        if not inputs.prompt_spans or inputs.prompt_logits is None:
            return None
        logprobs = inputs.prompt_logits.float().log_softmax(dim=-1)
        targets = torch.tensor(inputs.prompt_targets, device=logprobs.device)
        chosen = logprobs.gather(1, targets.view(-1, 1)).squeeze(1).tolist()
        k = max(span[3] for span in inputs.prompt_spans)
        top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        values, ids = top_values.tolist(), top_ids.tolist()
        result, at = {}, 0
        for request_id, first, count, span_k in inputs.prompt_spans:
            rows = range(at, at + count)
            result[request_id] = (first, [TokenLogprob(chosen[r], list(zip(ids[r][:span_k], values[r][:span_k],
                                                                           strict=True))) for r in rows])  # fmt: skip
            at += count
        return result

    @staticmethod
    def logprob_lists(tensors, num_rows: int):
        """`logprob_tensors`' result read back: a TokenLogprob (or None) per sampled row."""
        return sampler.logprob_lists(tensors, num_rows)


def _pick_linear(device: torch.device, dtype: torch.dtype):
    """F.linear, or on CPU (fp32, bf16) oneDNN's linear, which takes weights prepacked once and SiLU as a post-op.
    In fp32 it also avoids MKL: torch's fp32 CPU matmul goes to MKL, which on AMD CPUs runs its AVX2 kernels
    (measured 83-103 GFLOP/s per core on this EPYC, oneDNN 180-225 with AVX-512; 2 threads, a [2048, 512] x
    [512, 2752] matmul: 185 vs 433 GFLOP/s). bf16 matmuls already reach oneDNN, and prepacking saves about a fifth
    of a decode-sized one (32 x 512 x 1536, one thread: 152 -> 118 us). Checked once against F.linear; any surprise
    (op missing, build without oneDNN, wrong result) keeps F.linear."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return F.linear
    try:
        onednn = torch.ops.mkldnn._linear_pointwise
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 64), (24, 64), (24,)))
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        with torch.inference_mode():
            expected = F.linear(x[:, :48], w[:, :48], b).float()
            plain = onednn(x[:, :48], w[:, :48], b, "none", [], "").float()
            swish = onednn(x[:, :48], w[:, :48], b, "swish", [], "").float()  # the MLP's gate (SiLU post-op)
            if not (
                torch.allclose(plain, expected, atol=tolerance, rtol=tolerance)
                and torch.allclose(swish, F.silu(expected), atol=tolerance, rtol=tolerance)
            ):
                return F.linear
    except (AttributeError, RuntimeError):
        return F.linear

    def linear(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, post_op: str = "none"
    ) -> torch.Tensor:
        return onednn(x, weight, bias, post_op, [], "")

    return linear


def _partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Partial rotary (only the first rotary_dim dims of a head rotate, in pairs (i, i + rotary_dim/2)) as full-width
    rotate-half: the rotated pairs first in each half, the passed-through dims after them, paired with angle 0."""
    if (head_dim - rotary_dim) % 2:
        raise ModelLoadError(f"partial rotary over {rotary_dim} of {head_dim} head dims: an odd remainder")
    h, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(h), torch.arange(rotary_dim, rotary_dim + p), torch.arange(h, rotary_dim),
                      torch.arange(rotary_dim + p, head_dim)])  # fmt: skip


def _pad_rotary(cos: torch.Tensor, sin: torch.Tensor, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, rotary_dim] tables to [L, head_dim] in `_partial_rotary_order`'s layout: cos 1 and sin 0 where dims pass."""
    h, p = cos.shape[1] // 2, (spec.head_dim - cos.shape[1]) // 2
    ones, zeros = cos.new_ones(cos.shape[0], p), cos.new_zeros(cos.shape[0], p)
    return torch.cat([cos[:, :h], ones, cos[:, h:], ones], 1), torch.cat([sin[:, :h], zeros, sin[:, h:], zeros], 1)


def _permute_qk_dims(weights: ModelWeights, spec, order: torch.Tensor) -> ModelWeights:
    """Reorder the dims of every q and k head (new dim j is old dim order[j]): their projection rows, biases and
    q/k norm weights. Scores are unchanged: q and k get the same reordering and q.k sums over all dims; v keeps its
    order. The KV pool then holds K in this order too."""
    qk_heads = spec.num_heads + spec.num_kv_heads
    rows = (torch.arange(qk_heads).unsqueeze(1) * spec.head_dim + order).flatten()
    rows = torch.cat([rows, torch.arange(qk_heads * spec.head_dim, weights.layers[0].qkv.shape[0])])  # v as is
    layers = []
    for lw in weights.layers:
        rows_here, order_here = rows.to(lw.qkv.device), order.to(lw.qkv.device)
        layers.append(
            dataclasses.replace(
                lw,
                qkv=lw.qkv.index_select(0, rows_here),
                qkv_bias=None if lw.qkv_bias is None else lw.qkv_bias.index_select(0, rows_here),
                q_norm=None if lw.q_norm is None else lw.q_norm.index_select(0, order_here),
                k_norm=None if lw.k_norm is None else lw.k_norm.index_select(0, order_here),
            )
        )
    return dataclasses.replace(weights, layers=layers)


def _prepack_for_onednn(weights: ModelWeights) -> ModelWeights:
    """The projection weights in oneDNN's blocked layout, reordered once instead of on every call: [32, 512] x
    [512, 2752] one thread 0.53 -> 0.42 ms, [2048, 512] 27.5 -> 25.0 ms (the layout is chosen for 32 rows and serves
    any row count with identical results). Any failure keeps the plain weights, which oneDNN's linear also takes."""
    try:
        pack = torch.ops.mkldnn._reorder_linear_weight
        inter = weights.layers[0].down.shape[1]
        layers = [
            dataclasses.replace(
                lw,
                qkv=pack(lw.qkv, 32),
                o=pack(lw.o, 32),
                gate_up=None,  # gate and up apart: SiLU rides on the gate matmul (1024 tokens: 14.6 -> 13.4 ms)
                gate=pack(lw.gate_up[:inter].contiguous(), 32),
                up=pack(lw.gate_up[inter:].contiguous(), 32),
                gate_up_bias=None,
                gate_bias=None if lw.gate_up_bias is None else lw.gate_up_bias[:inter].contiguous(),
                up_bias=None if lw.gate_up_bias is None else lw.gate_up_bias[inter:].contiguous(),
                down=pack(lw.down, 32),
            )
            for lw in weights.layers
        ]
        return dataclasses.replace(weights, layers=layers, lm_head=pack(weights.lm_head, 32))
    except (AttributeError, RuntimeError):
        return weights


def _pick_attention(requested: str, device: torch.device, cpu_paths: bool) -> str:
    """The attention backend: `auto` is Triton on CUDA (torch ops if Triton is missing), the native kernel on the
    CPU fast paths, torch ops on the CPU's device-generic paths. Triton on a CPU runs only in its interpreter."""
    if requested == "auto":
        if device.type == "cuda":
            try:
                import triton  # noqa: F401
            except ImportError:
                log.warning("Triton is not installed: attention runs as torch ops per sequence")
                return "torch"
            return "triton"
        return "native" if cpu_paths else "torch"
    if requested == "native" and not cpu_paths:
        raise ConfigError(f"attention_backend 'native' is the CPU kernel; this runner is on {device.type}")
    if requested == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention_backend 'triton' on a CPU runs only in Triton's interpreter (TRITON_INTERPRET=1)")
    return requested


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but torch sees no CUDA device")
    return torch.device(name)


def _pick_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype, except that an fp32 (or undeclared) checkpoint runs in bf16 on CUDA, as vLLM
    does; on CPU an undeclared one stays fp32."""
    if name == "auto":
        name = checkpoint_dtype if checkpoint_dtype in _DTYPES else "float32"
        if device.type == "cuda" and name == "float32":
            name = "bfloat16"
    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (float32, bfloat16, float16)")
    return _DTYPES[name]
