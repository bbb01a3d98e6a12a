"""Tensor parallelism (Megatron-style, as vLLM does it): one model split across `size` ranks, a process each.

What each rank holds (`Shard`): its share of the query heads; its share of the KV heads, or one KV head shared by
several ranks when there are fewer KV heads than ranks; its share of the MLP's intermediate width; a slice of the
vocabulary for the embedding and the LM head. Norms are whole on every rank. So q|k|v and gate|up are split by
output rows (column-parallel), the output and down projections by input columns (row-parallel: each rank's partial
sum is added by one all-reduce, and only rank 0 adds their biases), the embedding by vocabulary rows (a rank looks
up the ids in its slice, zeros elsewhere, then one all-reduce) and the LM head by vocabulary rows (rank 0 gathers the
slices of the logits). A decode step is then 2 all-reduces per layer, the embedding's all-reduce and the LM head's
gather; `Collectives.count` says how many ran.

The ranks (`Ranks`, `runner.run_rank`): rank 0 is the engine (scheduler, KV block manager, sampling, the sidecar
link); every step it sends the step's batch to the other ranks over a pipe, each packs it as rank 0 did and runs its
shard of the forward, meeting rank 0 in the collectives. A rank that dies or hangs fails the collective (a closed
connection at once, a hang after `COLLECTIVE_TIMEOUT_S`): the step raises RankLost and the engine exits non-zero, so
the pod restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import multiprocessing
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from overlap.engine.errors import ModelLoadError, RankLost
from overlap.engine.model.experts import check_divides, shard_moe

COLLECTIVE_TIMEOUT_S = 10.0  # a rank that has not joined a collective by then is lost (the others wait as long)
START_TIMEOUT_S = 600.0  # every rank loaded and in the process group within this


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`: the row (or column) ranges of each weight it holds."""

    rank: int
    size: int
    q_heads: tuple[int, int]  # [first, last) query heads
    kv_heads: tuple[int, int]  # [first, last) KV heads (one head, shared with other ranks, when KV < size)
    inter: tuple[int, int]  # [first, last) of the MLP's intermediate width
    vocab: tuple[int, int]  # [first, last) vocabulary rows of the embedding and the LM head
    vocab_rows: int  # rows per rank's vocabulary slice, the last one padded with zero rows up to it

    @property
    def keeps_biases(self) -> bool:
        """Row-parallel biases are added once, by rank 0, after the all-reduce would have added them size times."""
        return self.rank == 0


def plan_shard(spec, rank: int, size: int) -> Shard:
    """Rank `rank`'s share of a model of this spec, or ModelLoadError naming the count `size` does not divide."""
    heads, kv, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    if heads % size:
        raise ModelLoadError(f"tensor_parallel_size {size} does not divide the {heads} attention heads")
    if kv % size and size % kv:
        raise ModelLoadError(f"tensor_parallel_size {size} neither divides the {kv} KV heads nor is a multiple of them")
    dense_layers = spec.moe is None or not all(spec.moe.sparse)  # an all-sparse MoE never runs that width
    if dense_layers and inter % size:
        raise ModelLoadError(f"tensor_parallel_size {size} does not divide the MLP's intermediate size {inter}")
    if spec.moe is not None:  # every rank holds every expert, a share of each one's width
        check_divides(spec.moe, size)
    per_q, per_inter = heads // size, inter // size
    if kv % size == 0:
        kv_heads = (rank * kv // size, (rank + 1) * kv // size)
    else:  # fewer KV heads than ranks: each is replicated on size / kv ranks
        kv_heads = (rank // (size // kv), rank // (size // kv) + 1)
    rows = math.ceil(spec.vocab_size / size)
    vocab = (min(rank * rows, spec.vocab_size), min((rank + 1) * rows, spec.vocab_size))
    return Shard(rank, size, (rank * per_q, (rank + 1) * per_q), kv_heads, (rank * per_inter, (rank + 1) * per_inter),
                 vocab, rows)  # fmt: skip


def shard_spec(spec, shard: Shard):
    """The spec as one rank's layers see it: its heads and intermediate width (the vocabulary stays whole), and its
    share of each expert's."""
    return dataclasses.replace(
        spec,
        num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.inter[1] - shard.inter[0],
        moe=None if spec.moe is None else shard_moe(spec.moe, shard),
    )


class Collectives:
    """The process group's collectives as the forward uses them, counted (tests hold the count per step). `group`
    has the short timeout of a step; the default group, with the start-up's, serves min_int."""

    def __init__(self, shard: Shard, group) -> None:
        self.shard, self.group = shard, group
        self.count = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.count += 1
        dist.all_reduce(t, group=self.group)
        return t

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` from the vocabulary-parallel table: each rank's own rows, zeros elsewhere, summed."""
        first, last = self.shard.vocab
        local = ids - first
        inside = (local >= 0) & (local < last - first)
        x = table.index_select(0, local.clamp(0, table.shape[0] - 1))
        x.mul_(inside.unsqueeze(1).to(x.dtype))
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, vocab] on rank 0 from each rank's [rows, vocab_rows] slice; other ranks get their slice back."""
        import torch.distributed as dist

        self.count += 1
        local = local.contiguous()
        if self.shard.rank != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the KV pool every rank can hold)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        if torch.distributed.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ---- the processes ---------------------------------------------------------------------------------------------
def init_group(rank: int, size: int, address: str, device: torch.device):
    """Join the ranks' process group (waiting up to START_TIMEOUT_S for all of them: they load as they start) and
    return a group over the same ranks whose collectives time out after COLLECTIVE_TIMEOUT_S."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=START_TIMEOUT_S))  # fmt: skip
    return dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Ranks:
    """Rank 0's handle on the other ranks: their processes, a pipe to each, and a watch on their exits (a rank that
    dies between steps; a step in flight fails on its own, in the collective)."""

    def __init__(self, config, model_dir: Path, random_weights: bool, address: str, target) -> None:
        """`target(rank, config, model_dir, random_weights, address, pipe)` runs each other rank (runner.run_rank)."""
        context = multiprocessing.get_context("spawn")  # a fork would copy rank 0's threads and torch state
        self.pipes, self.processes = [], []
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = context.Pipe()
            # daemonic: ended with rank 0, whatever state the collectives are in
            process = context.Process(target=target, name=f"overlap-rank-{rank}", daemon=True,
                                      args=(rank, config, str(model_dir), random_weights, address, theirs))  # fmt: skip
            process.start()
            theirs.close()
            self.pipes.append(ours)
            self.processes.append(process)
        self.closing = False

    def watch(self, on_lost) -> None:
        """Call `on_lost(why)` if another rank's process exits while rank 0 has not closed them."""
        threading.Thread(target=self._watch, args=(on_lost,), name="overlap-rank-watch", daemon=True).start()

    def _watch(self, on_lost) -> None:
        from multiprocessing.connection import wait

        gone = wait([p.sentinel for p in self.processes])
        if self.closing:
            return
        dead = next(p for p in self.processes if p.sentinel in gone)
        on_lost(f"tensor-parallel {dead.name} exited (code {dead.exitcode})")

    def send(self, step) -> None:
        """The step (runner.run_rank's message) to every other rank, before rank 0 enters the forward's collectives."""
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            try:
                pipe.send(step)
            except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                raise RankLost(f"tensor-parallel {process.name} is gone ({exc})") from exc

    def close(self) -> None:
        self.closing = True
        for pipe in self.pipes:
            with contextlib.suppress(OSError):  # that rank is gone already
                pipe.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
