"""The model runner: one step of a model over a paged KV pool allocated once, for the engine's executors.

A step is `prepare()` (the host: the scheduled sequences packed into token / position / slot tensors and attention
plans, `step_inputs.py`), then `device_step()` (the device: the model's forward, sampling, the logprobs asked for),
then `read_back()` (the host: logprobs as lists). `execute()` runs the three for the threaded executor; the CUDA
executor calls them on its streams (`execution/cuda.py`).

Where each part lives:

| part | module |
|---|---|
| a folder's config (what loads, what is refused) and its weights, fused | `model_spec.py`, `loader.py` |
| device, dtype, attention backend, KV-pool size | `devices.py` |
| a family's forward (Llama, Mistral, Qwen2, Phi-3; Qwen3; Gemma 1-3; their mixtures of experts) | `models/` |
| its layers: linear (oneDNN / torch), RMSNorm, RoPE with the K/V write, paged attention, MLP, experts | `layers/` |
| a mixture of experts' config fields and expert weights | `experts.py` |
| quantized checkpoints: each format read into one layout, the kernel picked per weight | `quant/`, `quant_w*.c` |
| GPU kernels: attention, RMSNorm, RoPE + K/V write, SiLU-mul (Triton) | `triton_attention.py`, `triton_ops.py` |
| GPU kernels: a sparse layer's experts (Triton) | `triton_moe.py` |
| input packing, the batch halves | `step_inputs.py` |
| how each sequence attends (native / torch / Triton plans) | `attention_plan.py` |
| sampling, logits controls, logprobs | `sampler.py`, `sampling_state.py` |
| CUDA graphs of decode steps | `graphs.py` |

KV pool layout (per K and V): one tensor [num_layers, num_kv_blocks * block_size, num_kv_heads, head_dim], i.e. a
layer's pool is a flat run of slots, block b holding slots b*bs .. b*bs + bs - 1::

    k_pool[layer]:  | block 0: slot 0..bs-1 | block 1 | block 2 | ... |      slot = table[pos // bs] * bs + pos % bs

With 2+ threads on CPU a step's batch may run as two halves, each a whole forward on its own Python thread with one
intra-op thread (torch releases the GIL inside kernels; the halves write disjoint KV slots). docs/engine.md has the
measurements behind each choice.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from overlap.engine import _malloc
from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError, ModelLoadError, RankLost
from overlap.engine.model import graphs, native, sampler
from overlap.engine.model.devices import kv_pool_blocks, pick_attention, pick_device, pick_dtype, split_kv_pool
from overlap.engine.model.draft import DraftModelProposer
from overlap.engine.model.helper import HelperThread
from overlap.engine.model.layers.attention import PagedAttention
from overlap.engine.model.layers.linear import LinearBackend, pick_linear_backend
from overlap.engine.model.layers.moe import SparseMoE
from overlap.engine.model.layers.rotary import Rotary, partial_rotary_layout
from overlap.engine.model.loader import ModelWeights, load_weights
from overlap.engine.model.loader import random_weights as make_random_weights
from overlap.engine.model.lora import LoraCache, lora_rows
from overlap.engine.model.model_spec import read_spec, rope_tables
from overlap.engine.model.models import ModelParts, build_model
from overlap.engine.model.parallel import Collectives, Ranks, free_address, init_group, plan_shard, shard_spec
from overlap.engine.model.quant.weight import QuantizedWeight
from overlap.engine.model.sampling_state import SamplingState
from overlap.engine.model.staging import to_device
from overlap.engine.model.step_inputs import InputPacker, StepInputs, decode_graph_inputs
from overlap.engine.types import NONFINITE_TOKEN, ModelInput, Runner, RunnerOutput, TokenLogprob

# The step plan `auto` (see _halves_min_tokens): halves for any step while the weights are at most this large; above
# it, only for steps of at least HALVES_MIN_TOKENS tokens, whose arithmetic outweighs reading every weight twice.
HALVES_MAX_WEIGHT_BYTES = 256 << 20
HALVES_MIN_TOKENS = 256


@dataclass(slots=True)
class DeviceStep:
    """A step launched on the device: its inputs, the sampled tokens, what the host reads back, the logprobs."""

    inputs: StepInputs
    tokens: torch.Tensor  # int64 [S], the sampled ids (a sequence with proposals: the last token it appends)
    readback: torch.Tensor  # the same, NONFINITE_TOKEN where a row's logits were not finite
    logprobs: object  # `sampler.logprob_tensors` (None when no request asked), per sampled row
    spec: tuple[torch.Tensor, torch.Tensor] | None = None  # `sampler.verify_proposals`' accepted counts and tokens


class ModelRunner(Runner):
    supports_speculation = True

    def __init__(self, config: EngineConfig, model_dir: Path | str, *, cpu_paths: bool = True, native_ops: bool = True,
                 random_weights: bool = False, rank: int = 0, address: str | None = None) -> None:  # fmt: skip
        """`cpu_paths=False` runs on CPU the device-generic paths CUDA takes (F.linear, per-sequence SDPA, no native
        kernel, no half-batch threads), so tests cover that branch on a machine without a GPU; `native_ops=False`
        keeps the CPU paths but replaces the native C kernels by torch ops. `random_weights` makes the weights on the
        device from config.json's shape instead of reading a checkpoint (benchmarks). With
        `config.tensor_parallel_size` > 1, rank 0 (the engine's runner) starts the other ranks, which build their
        runner with their `rank` and rank 0's `address` (model/parallel.py)."""
        self.config = config
        self.model_dir = Path(model_dir)
        size = config.tensor_parallel_size
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif size > 1:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
        self.device = device = pick_device(config.device, rank)
        self.cpu_paths = device.type == "cpu" and cpu_paths
        self.spec = spec = read_spec(self.model_dir, config.quantization)
        self.shard = plan_shard(spec, rank, size) if size > 1 else None  # a size the heads refuse fails here, at once
        self.ranks: Ranks | None = None
        self.tp: Collectives | None = None
        self.helper: HelperThread | None = None
        self.draft: DraftModelProposer | None = None  # speculative decoding's draft model (rank 0): model/draft.py
        self.lora: LoraCache | None = None
        try:
            if self.shard is not None:
                if rank == 0:
                    address = free_address()
                    self.ranks = Ranks(config, self.model_dir, random_weights, address, run_rank)
                self.tp = Collectives(self.shard, init_group(rank, size, address, device))
            self._build(config, spec, device, rank, native_ops, random_weights)
            if rank == 0 and config.speculative is not None and config.speculative.method == "draft_model":
                self.draft = DraftModelProposer(config, self, ModelRunner)
        except BaseException:  # the other ranks go too
            self.close()
            raise
        _malloc.keep_freed_memory()  # the load's temporaries given back, then a step's buffers kept for the next

    def _build(self, config: EngineConfig, spec, device: torch.device, rank: int, native_ops: bool,
               random_weights: bool) -> None:  # fmt: skip
        layer_spec = spec if self.shard is None else shard_spec(spec, self.shard)
        self.dtype = dtype = pick_dtype(config.dtype, spec.torch_dtype, device)
        self.attention_backend = pick_attention(config.attention_backend, device, self.cpu_paths)
        self.step_mode = "cuda" if device.type == "cuda" else "thread"
        self.vocab_size = spec.vocab_size
        self.eos_token_ids = tuple(spec.eos_token_ids)
        self.sampling_defaults = dict(spec.sampling_defaults)
        self.max_model_len = min(config.max_seq_len, spec.max_position_embeddings, spec.rope_context_cap or 1 << 62)
        self.block_size = config.block_size

        triton = None
        if self.attention_backend == "triton":  # every sequence's attention in one Triton launch per layer
            from overlap.engine.model import triton_attention as triton
            from overlap.engine.model.triton_ops import TritonOps
        use_native = self.cpu_paths and native_ops and dtype in native.DecodeAttentionKernel.DTYPES
        decode_kernel = native.decode_attention_kernel() if use_native and self.attention_backend == "native" else None
        # RMSNorm, RoPE with the K/V write (and argmax): native on CPU, Triton kernels next to the Triton attention
        self.ops = native.cpu_ops() if use_native else (TritonOps() if triton is not None else None)
        self.linear: LinearBackend = pick_linear_backend(device, dtype) if self.cpu_paths else LinearBackend()
        self.linear.quantized_triton = triton is not None
        self.helper = HelperThread()
        with torch.inference_mode():
            if random_weights:
                shape = layer_spec if self.shard is None else dataclasses.replace(
                    layer_spec, vocab_size=self.shard.vocab_rows)  # fmt: skip
                weights = make_random_weights(shape, dtype, device, config.seed + rank)
            else:
                weights = load_weights(spec, self.model_dir, dtype, device, self.shard)
            # the streaming floor of a decode step (with the K/V), and the multiply-adds per row behind it
            self.weight_bytes, self.weight_params = _weight_bytes(weights)
            self.expert_bytes = _bytes_and_params([t for layer in weights.layers if layer.moe is not None
                                                   for t in layer.moe.experts()])[0]  # fmt: skip
            cos, sin = rope_tables(spec, self.max_model_len, self.model_dir)
            partial_rotary = cos.shape[1] != spec.head_dim  # q and k rows reordered below
            weights, cos, sin = partial_rotary_layout(layer_spec, weights, cos, sin)
            rotary = Rotary(cos.to(device, dtype), sin.to(device, dtype), self.ops)
            sliding_rotary = None
            if spec.rope_by_layer_type:  # Gemma 3: the sliding layers' own RoPE base
                cos, sin = rope_tables(spec, self.max_model_len, self.model_dir, "sliding_attention")
                if cos.shape[1] != spec.head_dim:
                    raise ModelLoadError("partial rotary in a model whose layer types have their own RoPE")
                sliding_rotary = Rotary(cos.to(device, dtype), sin.to(device, dtype), self.ops)
            num_blocks = kv_pool_blocks(config, layer_spec, dtype, device, self.max_model_len)
            if self.tp is not None:  # every rank's pool holds the same blocks: the fewest any rank has room for
                num_blocks = self.tp.min_int(num_blocks)
            self.kv_split = split_kv_pool(config, spec, num_blocks)  # None unless sliding and full layers mix
            self.num_kv_blocks = num_blocks if self.kv_split is None else self.kv_split.num_full_blocks
            # With Triton, one spare block past the usable ones: a CUDA graph's padding rows write and read it.
            pool_blocks = self.num_kv_blocks + (triton is not None)
            full_layers = [i for i, w in enumerate(spec.layer_windows) if self.kv_split is None or w is None]
            shape = (len(full_layers), pool_blocks * self.block_size, layer_spec.num_kv_heads, spec.head_dim)
            # torch.empty: on CPU the pages are committed only when written; nothing reads a slot before it is
            # written (a sequence attends only to its own computed positions).
            self.k_pool = torch.empty(shape, dtype=dtype, device=device)
            self.v_pool = torch.empty(shape, dtype=dtype, device=device)
            k_layers = dict(zip(full_layers, self.k_pool, strict=True))
            v_layers = dict(zip(full_layers, self.v_pool, strict=True))
            if self.kv_split is not None:  # the sliding layers' pool: block 0 is the null block, read as zeros
                window_layers = [i for i in range(spec.num_layers) if i not in k_layers]
                shape = (len(window_layers), (self.kv_split.num_window_blocks + 1) * self.block_size, *shape[2:])
                self.window_k_pool = torch.empty(shape, dtype=dtype, device=device)
                self.window_v_pool = torch.empty(shape, dtype=dtype, device=device)
                for pool in (self.window_k_pool, self.window_v_pool):
                    pool[:, : self.block_size].zero_()
                k_layers.update(zip(window_layers, self.window_k_pool, strict=True))
                v_layers.update(zip(window_layers, self.window_v_pool, strict=True))
            self.attention = PagedAttention(
                heads=layer_spec.num_heads, kv_heads=layer_spec.num_kv_heads, head_dim=spec.head_dim,
                block_size=self.block_size,
                dtype=dtype, decode_kernel=decode_kernel, triton=triton, cpu_paths=self.cpu_paths, helper=self.helper,
                scale=spec.attention_scale, softcap=spec.attn_logit_softcapping,
            )  # fmt: skip
            parts = ModelParts(layer_spec, weights, self.linear, self.ops, self.attention, rotary,
                               [k_layers[i] for i in range(spec.num_layers)],
                               [v_layers[i] for i in range(spec.num_layers)], self.tp, sliding_rotary,
                               window_pool=self.kv_split is not None)  # fmt: skip
            self.model = build_model(parts)
            del weights, parts  # the layers hold what they use (oneDNN's packed copies on CPU)
            if config.enable_lora:
                if partial_rotary:
                    raise ModelLoadError("LoRA adapters on a model with partial rotary are not supported")
                self.lora = LoraCache(spec, layer_spec, self.shard, config.max_lora_rank, config.num_cpu_loras,
                                      share=self.ranks is not None)  # fmt: skip
                self.lora.attach(self.model, config.max_loras, dtype, device)
        halves_min_tokens = self._halves_min_tokens(config.cpu_step_plan)
        self.packer = InputPacker(
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, max_model_len=self.max_model_len,
            device=device, windows=sorted({w for w in spec.layer_windows if w is not None}),
            num_window_blocks=None if self.kv_split is None else self.kv_split.num_window_blocks,
            use_decode_kernel=decode_kernel is not None, triton=triton,
            group=layer_spec.num_heads // layer_spec.num_kv_heads,
            halves_min_tokens=halves_min_tokens,
        )  # fmt: skip
        argmax = None if self.ops is None else self.ops.argmax
        self.sampling = SamplingState(self.model_dir, spec.vocab_size, frozenset(self.eos_token_ids), device,
                                      config.seed, argmax)  # fmt: skip
        # Not yet under tensor parallelism: a captured graph would hold the collectives of one step.
        # nor with LoRA: a graph would hold one step's row groups
        if device.type == "cuda" and triton is not None and config.cuda_graphs and self.tp is None and (
                self.kv_split is None) and not config.enable_lora:  # fmt: skip
            self.enable_decode_graphs(graphs.cuda_capture(device))

    def _halves_min_tokens(self, plan: str) -> int | None:
        """The fewest tokens a step runs as two halves under `EngineConfig.cpu_step_plan` (None: never). Halves have
        no barrier per op but read every weight twice: auto takes them for small weights, and for large ones only in
        steps with enough arithmetic to hide the second read (prefill); docs/engine.md has the measurements."""
        # a rank's forward is one whole batch; LoRA's row groups are one per step, for one forward
        if not self.cpu_paths or plan == "whole" or self.tp is not None or self.config.enable_lora:
            return None
        if self.spec.quantization is not None and plan == "auto":
            # quantized kernels run on all threads inside each call and a prefill dequantizes each weight once: two
            # halves would run them on twice the cores there are and dequantize every weight twice
            return None
        if plan == "halves" or self.weight_bytes <= HALVES_MAX_WEIGHT_BYTES:
            return 0
        return HALVES_MIN_TOKENS

    def enable_decode_graphs(self, capture, limit: int | None = None) -> None:
        """Capture the decode forward for every bucket up to `limit` (default: the largest max_num_seqs the pool
        allows, so live retuning never captures again). `capture(fn) -> replay` is `graphs.cuda_capture` on CUDA;
        tests pass one that runs eagerly."""
        triton = self.attention.triton
        if triton is None or self.cpu_paths:
            raise ConfigError("decode graphs need the Triton attention backend on the device paths")
        if self.kv_split is not None:
            raise ConfigError("decode graphs do not yet carry the sliding layers' block tables")
        width = -(-self.max_model_len // self.block_size)

        def make_inputs(buffer: torch.Tensor, bucket: int) -> StepInputs:
            return decode_graph_inputs(buffer, bucket, width, triton, self.device)

        with torch.inference_mode():
            self.packer.graphs = graphs.DecodeGraphs(
                graphs.decode_buckets(limit or self.num_kv_blocks), width, self.num_kv_blocks, self.block_size,
                self.vocab_size, self.device, self.dtype, make_inputs, self.model.forward, capture,
            )  # fmt: skip

    @property
    def graph_steps(self) -> int:
        """Steps served by a captured graph so far (0 without graphs)."""
        return 0 if self.packer.graphs is None else self.packer.graphs.replayed

    @property
    def kernels(self) -> str:
        """What runs the step's work on this machine, for start-up logs and benchmarks."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.device.type != "cpu":
            ops = "torch RMSNorm, RoPE" if self.ops is None else self.ops.name
            return f"{self.device.type} {dtype}: {self.linear_kernels}; {self.attention.name}; {ops}"
        norms = "native RMSNorm, RoPE, argmax" if self.ops is not None else "torch RMSNorm, RoPE, argmax"
        isa = f"torch {torch.backends.cpu.get_cpu_capability()}"
        plan = {None: "whole batch on all threads", 0: "batch halves on two threads"}.get(
            self.packer.halves_min_tokens, f"halves for steps of {self.packer.halves_min_tokens}+ tokens, else whole"
        )
        return f"CPU {native.cpu_isa()} {dtype}: {self.linear_kernels}; {self.attention.name}; {norms}; {plan}; {isa}"

    @property
    def linear_kernels(self) -> str:
        """What computes the projections: the float backend, or the checkpoint's format and its kernels."""
        quant = self.spec.quantization
        if quant is None:
            return self.linear.name
        layer, mlp = self.model.layers[0], self.model.layers[0].mlp
        mlp_linears = [getattr(mlp, name, None) for name in ("gate_up", "gate", "up", "down")]  # none in an MoE layer
        linears = [layer.qkv, layer.o, *mlp_linears, self.model.head]
        kernels = dict.fromkeys(lin.kernel for lin in linears if lin is not None)
        return f"{quant.name} through {' and '.join(kernels)}" + self._expert_kernels(quant)

    def _expert_kernels(self, quant) -> str:
        """What computes a quantized mixture's experts ("" for a dense model, and for MXFP4, whose name says it)."""
        sparse = next((layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)), None)
        if sparse is None or quant.method == "mxfp4":
            return ""
        expert = sparse.experts[0].gate_up if sparse.experts else None
        kernel = expert.quant.name if expert is not None and expert.quant is not None else "dequantized at load"
        return f"; experts: {kernel}"

    def to_device(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """int64 tensors on the runner's device without blocking the host (`staging.to_device`)."""
        return to_device(self.device, *lists)

    # ---- one step ---------------------------------------------------------------------------------------------
    def execute(self, batch: ModelInput) -> RunnerOutput:
        """Run one step; one sampled token per sequence with do_sample, in order."""
        inputs = self.prepare(batch)
        start = time.perf_counter()
        threads = torch.get_num_threads()
        try:
            with torch.inference_mode():
                if inputs.halves is not None:
                    # Sample on one thread too: the first OpenMP region after going back to 2 threads pays for
                    # waking the team (batch-64 greedy sampling measured 2.9 ms that way, 0.4 ms on one thread).
                    torch.set_num_threads(1)
                step = self.device_step(inputs)
                tokens = step.readback.tolist()  # waits for the device
                logprobs, prompt_logprobs, spec_tokens, spec_logprobs = self.read_back(step)
        finally:
            torch.set_num_threads(threads)
        return RunnerOutput(tokens, (start, time.perf_counter()), logprobs, prompt_logprobs, spec_tokens,
                            spec_logprobs)  # fmt: skip

    def prepare(self, batch: ModelInput) -> StepInputs:
        inputs = self.packer.pack(batch)
        inputs.batch = batch
        if self.lora is not None:
            inputs.lora_filled = [self.lora.activate(*load) for load in batch.lora_loads]
            inputs.lora = lora_rows(batch.seqs, self.device)
        return inputs

    def device_step(self, inputs: StepInputs) -> DeviceStep:
        """The step's device work, with no host sync but for a grammar's matcher: forward, sampling (with the
        logits controls), the request histories, the logprobs asked for."""
        logits = self.forward(inputs)
        tokens, finite = self.sampling.sample(logits, inputs)
        tokens = tokens.to(torch.long)
        self.sampling.record(inputs, tokens)
        logprobs = sampler.logprob_tensors(logits, inputs.sampling, tokens)
        if inputs.spec:  # speculative decoding: a row per scored position; accept proposals on the device
            seq_tokens, readback, spec = sampler.verify_proposals(tokens, finite, inputs.seq_rows, inputs.spec)
            return DeviceStep(inputs, seq_tokens, readback, logprobs, spec)
        return DeviceStep(inputs, tokens, torch.where(finite, tokens, NONFINITE_TOKEN), logprobs)

    @staticmethod
    def read_back(step: DeviceStep) -> tuple[list[TokenLogprob | None] | None, dict | None, dict | None, dict | None]:
        """A finished step's logprobs on the host: per sampled sequence, and the prompt logprobs by request; and for
        sequences with proposals what each appends, with those tokens' logprobs when asked (`RunnerOutput`)."""
        inputs = step.inputs
        logprobs = sampler.logprob_lists(step.logprobs, len(inputs.sampling))
        spec_tokens = spec_logprobs = None
        if step.spec is not None:  # per sampled row so far: regroup by sequence
            accepted, table = step.spec[0].tolist(), step.spec[1].tolist()
            last_rows = list(inputs.seq_rows)
            spec_tokens, spec_logprobs = {}, ({} if logprobs is not None else None)
            for (seq, first, _), num, row in zip(inputs.spec, accepted, table, strict=True):
                request_id = inputs.request_ids[first]
                spec_tokens[request_id] = row[: num + 1]
                last_rows[seq] = first + num
                if logprobs is not None:
                    spec_logprobs[request_id] = logprobs[first : first + num + 1]
            if logprobs is not None:
                logprobs = [logprobs[row] for row in last_rows]
        prompt_logprobs = None
        if inputs.prompt_spans and inputs.prompt_logits is not None:
            prompt_logprobs = sampler.prompt_logprob_lists(inputs.prompt_logits, inputs.prompt_targets,
                                                           inputs.prompt_spans)  # fmt: skip
        return logprobs, prompt_logprobs, spec_tokens, spec_logprobs

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [num sampled seqs, vocab] (model dtype); writes the step's K/V into the pool. A batch prepared in
        two halves runs as two forwards, one per Python thread with one intra-op thread each."""
        if inputs.graph is not None:
            return self.packer.graphs.run(*inputs.graph)
        if self.ranks is not None:
            self.ranks.send((inputs.batch, inputs.lora_filled))
            try:
                return self.model.forward(inputs)
            except RuntimeError as exc:  # gloo / NCCL: a rank closed its connection or missed the timeout
                raise RankLost(f"tensor-parallel step failed: {exc}") from exc
        if inputs.halves is None:
            return self.model.forward(inputs)
        first, second = inputs.halves
        threads = torch.get_num_threads()  # 1 when called from execute()

        def run_half(half: StepInputs) -> torch.Tensor:
            torch.set_num_threads(1)  # this thread's own OpenMP setting
            with torch.inference_mode():
                return self.model.forward(half)

        torch.set_num_threads(1)
        try:
            future = self.helper.submit(run_half, second)
            logits = self.model.forward(first)
            return torch.cat([logits, future.result()])
        finally:
            torch.set_num_threads(threads)

    def compute_logits(self, batch: ModelInput) -> torch.Tensor:
        """Logits [num sampled seqs, vocab] in fp32 (tests compare them with transformers)."""
        with torch.inference_mode():
            return self.forward(self.prepare(batch)).float()

    # ---- per-request state and lifetime ------------------------------------------------------------------------
    def add_grammar(self, request_id: str, grammar: str) -> None:
        self.sampling.add_grammar(request_id, grammar)

    def read_lora(self, name: str, path: str) -> int:
        if self.lora is None:
            raise ConfigError("LoRA adapters need enable_lora (--enable-lora)")
        return self.lora.read(name, path).rank

    def stage_lora(self, name: str, path: str) -> bool | str:
        return True if self.lora is None else self.lora.stage(name, path)

    def forget_request(self, request_id: str) -> None:
        self.sampling.forget(request_id)
        if self.draft is not None:
            self.draft.forget([request_id])

    def on_lost(self, callback) -> None:
        """`callback(why)` when another tensor-parallel rank's process exits (none on one rank)."""
        if self.ranks is not None:
            self.ranks.watch(callback)

    def close(self) -> None:
        """Stop the helper thread and the other tensor-parallel ranks (the KV pool and weights go with the object)."""
        if self.helper is not None:
            self.helper.close()
        if self.draft is not None:
            self.draft.close()
        if self.ranks is not None:
            self.ranks.close()
        if self.tp is not None:
            self.tp.close()
        if self.lora is not None:
            self.lora.close()


def run_rank(rank: int, config: EngineConfig, model_dir: str, random_weights: bool, address: str, pipe) -> None:
    """A tensor-parallel rank other than 0, in its own process: build its shard, then run the forward of every batch
    rank 0 sends, with the LoRA adapters whose slots it fills (rank 0's copies), until None (or rank 0's end of the
    pipe closes)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    runner = ModelRunner(config, model_dir, random_weights=random_weights, rank=rank, address=address)
    try:
        while True:
            try:
                message = pipe.recv()
            except EOFError:
                return
            if message is None:
                return
            batch, adapters = message
            for adapter in adapters:
                runner.lora.hold(adapter)
            with torch.inference_mode():
                runner.model.forward(runner.prepare(batch))
    finally:
        runner.close()


def _weight_bytes(weights: ModelWeights) -> tuple[int, int]:
    """Bytes of weights a decode step streams (every tensor once, but the embedding table, of which a step reads
    only its tokens' rows, unless it is tied to the LM head, which reads it all; quantized ones as stored), and the
    number of weights among them."""
    tensors = [weights.norm, weights.lm_head]
    tensors += [getattr(layer, f.name) for layer in weights.layers for f in dataclasses.fields(layer)]
    tensors += [t for layer in weights.layers if layer.moe is not None for t in layer.moe.tensors()]  # every expert
    return _bytes_and_params(tensors)


def _bytes_and_params(tensors: list) -> tuple[int, int]:
    """Bytes (quantized weights as stored) and weights of the distinct tensors among `tensors`."""
    distinct = {id(t): t for t in tensors if isinstance(t, torch.Tensor | QuantizedWeight)}
    quantized = [t for t in distinct.values() if isinstance(t, QuantizedWeight)]
    plain = [t for t in distinct.values() if not isinstance(t, QuantizedWeight)]
    nbytes = sum(t.nbytes for t in quantized) + sum(t.numel() * t.element_size() for t in plain)
    return nbytes, sum(t.codes.numel() for t in quantized) + sum(t.numel() for t in plain)
