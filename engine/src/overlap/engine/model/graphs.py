"""CUDA graphs for decode steps: the whole forward of a decode-only step replayed as one graph, so a step costs one
launch instead of one per kernel (a ~8B model's decode forward is several hundred kernels, whose launch time alone
exceeds a small batch's device time).

A graph replays fixed shapes and fixed addresses, so each captured batch size ("bucket") owns static buffers: one
int64 buffer with the step's token ids, positions, K/V slots, context lengths and block tables (padded to the
longest sequence the model allows), and the logits it writes. A step of n decodes takes the smallest bucket >= n:
its inputs are staged on the host already padded, copied into the bucket's buffer on the compute stream (so the copy
waits for the previous replay of that bucket), and the graph replays; logits[:n] go to sampling, which stays eager
(its shapes depend on the requests' parameters). Padding rows attend over one position of a block no sequence owns
(the pool's spare block) and write their K/V there.

The buckets reach the largest batch the KV pool allows (at most GRAPH_BATCH_LIMIT), captured once at start-up, so
raising max_num_seqs live never captures or allocates. Prompt chunks, prompt logprobs and batches past the largest
bucket run eagerly.

`capture(fn) -> replay` is the seam: on CUDA it records `fn` into a torch.cuda.CUDAGraph; tests on a CPU pass one that
runs `fn` eagerly, so the buckets, padding and static buffers are exercised with the real kernels (Triton's
interpreter) and compared with eager steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GRAPH_BATCH_LIMIT = 512  # the largest captured batch (vLLM's default too)
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def decode_buckets(limit: int) -> list[int]:
    """Captured batch sizes up to `limit` (capped at GRAPH_BATCH_LIMIT), `limit` itself the last. Coarse steps: a
    padded decode row costs activations and one K/V position, not another pass over the weights."""
    limit = min(limit, GRAPH_BATCH_LIMIT)
    return [b for b in _BUCKETS if b < limit] + [limit]


def cuda_capture(device: torch.device) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Capture into CUDA graphs sharing one memory pool: `fn` runs once on a side stream (compiles the Triton
    kernels, sets up cuBLAS), then is recorded."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        return graph.replay

    return capture


class DecodeGraphs:
    """One captured decode forward per bucket, with its static buffers.

    `forward(inputs) -> logits` is the runner's eager forward of a `StepInputs`; `make_inputs(buffer, bucket)` builds
    the StepInputs whose tensors are views of the bucket's static `buffer` (laid out as `pack` writes it)."""

    def __init__(self, buckets: list[int], width: int, spare_block: int, block_size: int, vocab_size: int,
                 device: torch.device, dtype: torch.dtype, make_inputs, forward, capture) -> None:  # fmt: skip
        self.buckets = buckets
        self.width = width  # block-table entries per sequence: the longest sequence's
        self.spare_block = spare_block
        self.block_size = block_size
        self._buffers: dict[int, torch.Tensor] = {}
        # Each bucket's StepInputs: a graph reads their tensors (rows, plan) by address but holds no reference, so
        # they must live as long as it does.
        self._inputs: dict[int, object] = {}
        self._replays: dict[int, Callable[[], None]] = {}
        self.replayed = 0  # steps served by a graph (stats and tests)
        # One logits buffer, each bucket writing its first rows (graphs replay one at a time, in stream order).
        self._logits = torch.empty(buckets[-1], vocab_size, dtype=dtype, device=device)
        for bucket in reversed(buckets):  # largest first: the smaller ones reuse its pool memory
            buffer = torch.tensor(self.pack([], bucket), dtype=torch.long).to(device)
            inputs, logits = make_inputs(buffer, bucket), self._logits[:bucket]
            self._buffers[bucket] = buffer
            self._inputs[bucket] = inputs
            self._replays[bucket] = capture(lambda inputs=inputs, logits=logits: logits.copy_(forward(inputs)))

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` decodes; None past the largest (the step runs eagerly)."""
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        return None

    def pack(self, decodes: list[tuple[int, int, int, list[int]]], bucket: int) -> list[int]:
        """The bucket's buffer contents for decodes (token, position, slot, block table): token ids, positions, slots,
        context lengths, then the tables, each padded; padding rows use the spare block."""
        pad = bucket - len(decodes)
        spare = self.spare_block * self.block_size
        ids = [d[0] for d in decodes] + [0] * pad
        positions = [d[1] for d in decodes] + [0] * pad
        slots = [d[2] for d in decodes] + [spare] * pad
        kv_lens = [d[1] + 1 for d in decodes] + [1] * pad
        tables = []
        for _, _, _, table in decodes:
            tables += table[: self.width] + [self.spare_block] * (self.width - len(table))
        tables += [self.spare_block] * (self.width * pad)
        return ids + positions + slots + kv_lens + tables

    def run(self, staged: torch.Tensor, bucket: int, num_seqs: int) -> torch.Tensor:
        """Replay the bucket's graph on `staged` (a packed buffer on the device); logits [num_seqs, vocab]."""
        self._buffers[bucket].copy_(staged)  # on the current stream: after the previous replay of this bucket
        self._replays[bucket]()
        self.replayed += 1
        return self._logits[:num_seqs]


def buffer_views(buffer: torch.Tensor, bucket: int, width: int) -> tuple[torch.Tensor, ...]:
    """(token ids, positions, slots, context lengths, tables [bucket, width]) of a packed buffer."""
    ids, positions, slots, kv_lens, tables = buffer.split([bucket] * 4 + [bucket * width])
    return ids, positions, slots, kv_lens, tables.view(bucket, width)
