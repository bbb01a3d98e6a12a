"""LoRA adapters in PEFT's format, applied beside the base linear layers (vLLM's `lora/` in miniature).

An adapter is a folder of `adapter_config.json` and `adapter_model.safetensors`, as PEFT's `save_pretrained` writes
it. Each adapted module of layer i holds lora_A [r, in] and lora_B [out, r]; the module's output gains
scaling * B (A x), scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). `read_adapter` maps PEFT's module
names onto the engine's fused projections (q|k|v, gate|up) and refuses what cannot apply to this base: an unknown
target module, a rank above `max_lora_rank`, a shape of another base model, PEFT options this engine does not run.

On the device every adapted projection holds `max_loras` slots (`LoraDelta`): A stacked over the projection's
segments ([slots, segments * max_rank, in]) and B block-diagonal ([slots, out, segments * max_rank]; on CPU stored
transposed per slot), zero where an adapter has a smaller rank or no such module, scaling folded into B. On CPU one
native call per projection adds every row's delta (`native.LoraKernel`, lora_delta.c: the step's rows ordered by
slot, `RowSlots`; it skips the ranks where a slot's B is zero, `LoraDelta.spans`); a step of one adapter's rows past
`LoraKernel.ROWS_ONE_ADAPTER` (its prefill), or every step without the native library, is gathered per slot, shrunk
by A and expanded by B in two matmuls and added back. On CUDA two Triton launches per projection take a slot per row
(`triton_lora.py`, BGMV). The base kernel (oneDNN, native, quantized) never changes: `Linear` adds the delta after it.

Under tensor parallelism each rank keeps its share: a column-parallel projection (q|k|v, gate|up) its rows of B, a
row-parallel one (o, down) its columns of A (its partial sum is all-reduced with the base's).

`LoraCache` is the host side of one runner: adapters read from disk, least recently used first out past
`max_cpu_loras`; a slot is (re)filled from it when the scheduler assigns an adapter to it. An adapter not in host
memory is read on a thread of its own before a request through it is admitted (`stage`), so no step waits on a disk
and an unreadable folder fails only that adapter's requests. Under tensor parallelism rank 0 alone reads: the step
that fills a slot carries rank 0's copy to the other ranks, as one block of shared memory (`LoraAdapter.shared`).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from overlap.engine.errors import ADAPTER_NOT_FOUND, ModelLoadError
from overlap.engine.model.native import LoraKernel, lora_kernel

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT module name -> (the engine's projection, its segment there): q|k|v and gate|up are one matmul each here.
# Phi-3's checkpoints fuse them already (qkv_proj, gate_up_proj): one segment over the whole output.
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", 0), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "gate_up_proj": ("gate_up", 0), "down_proj": ("down", 0),
}  # fmt: skip
SEGMENTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
# the language model's layers only (a vision tower's `encoder.layers` are not these)
_KEY = re.compile(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
STAGE_ERROR_S = 10.0  # how long a failed staging read answers for its adapter before a new request reads again
# PEFT options that change what the delta is; refused by name rather than computed wrongly
_REFUSED = {
    "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas", "modules_to_save": "modules_to_save (fully trained modules)",
}  # fmt: skip


class LoraError(ModelLoadError):
    """An adapter that cannot be served on this base model (the message says why)."""


@dataclass(slots=True)
class LoraAdapter:
    """An adapter on the host: per (layer, PEFT module), A [r, in] and scaling * B [out, r] in fp32."""

    name: str
    path: str
    rank: int
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    block: torch.Tensor | None = None  # the shared memory every module's tensors are views of (`shared`)

    def shared(self) -> LoraAdapter:
        """This adapter with its tensors as views of one block of shared memory (itself if they are already): a
        pipe to another process then passes that block (torch.multiprocessing: a file descriptor), not a copy."""
        if self.block is not None:
            return self
        tensors = [t for pair in self.modules.values() for t in pair]
        block = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32).share_memory_()
        views = _views(block, [t.shape for t in tensors])
        for view, tensor in zip(views, tensors, strict=True):
            view.copy_(tensor)
        pairs = dict(zip(self.modules, zip(views[::2], views[1::2], strict=True), strict=True))
        return LoraAdapter(self.name, self.path, self.rank, self.scaling, pairs, block)

    def __reduce__(self):
        """Pickled as its shared block and the modules' shapes: one file descriptor, however many modules."""
        adapter = self.shared()
        shapes = [(key, a.shape, b.shape) for key, (a, b) in adapter.modules.items()]
        return _unpickle_adapter, (adapter.name, adapter.path, adapter.rank, adapter.scaling, adapter.block, shapes)


def _views(block: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of `block` with these shapes."""
    views, offset = [], 0
    for shape in shapes:
        views.append(block[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return views


def _unpickle_adapter(name, path, rank, scaling, block, shapes) -> LoraAdapter:
    views = _views(block, [shape for _, a, b in shapes for shape in (a, b)])
    pairs = {key: (views[2 * i], views[2 * i + 1]) for i, (key, _, _) in enumerate(shapes)}
    return LoraAdapter(name, path, rank, scaling, pairs, block)


def module_geometry(spec) -> dict[str, tuple[int, int, int]]:
    """PEFT module -> (first output row in its projection, outputs, inputs) on the whole (unsharded) model."""
    q, kv, hidden, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size, 0
    geometry = {"q_proj": (0, q, hidden), "k_proj": (q, kv, hidden), "v_proj": (q + kv, kv, hidden),
                "qkv_proj": (0, q + 2 * kv, hidden), "o_proj": (0, hidden, q)}  # fmt: skip
    if spec.moe is None:  # a mixture of experts' MLP is not a plain linear layer: adapters on it are refused
        inter = spec.intermediate_size
        geometry |= {"gate_proj": (0, inter, hidden), "up_proj": (inter, inter, hidden),
                     "gate_up_proj": (0, 2 * inter, hidden), "down_proj": (0, hidden, inter)}  # fmt: skip
    return geometry


def read_adapter(name: str, path: str | Path, spec, max_rank: int) -> LoraAdapter:
    """The adapter in PEFT folder `path`, checked against the base model's `spec`; LoraError says what is wrong."""
    from safetensors.torch import load_file

    folder = Path(path)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except OSError as exc:
        raise LoraError(f"adapter {name!r}: {ADAPTER_NOT_FOUND} {str(folder)!r} ({exc.strerror})") from None
    except ValueError as exc:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} must hold an object, got {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"adapter {name!r}: {what} ({key}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if type(rank) is not int or rank < 1 or not isinstance(alpha, int | float):
        raise LoraError(f"adapter {name!r}: r must be an integer >= 1 and lora_alpha a number, got {rank!r}, {alpha!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}")
    geometry = module_geometry(spec)
    targets = config.get("target_modules") or []
    # a string is PEFT's regular expression over module names: the tensors below say which modules it took
    if not isinstance(targets, str) and (not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)):
        raise LoraError(f"adapter {name!r}: target_modules must be a list of module names or a regular expression, "
                        f"got {targets!r}")  # fmt: skip
    unknown = [] if isinstance(targets, str) else [t for t in targets if t.rsplit(".", 1)[-1] not in geometry]
    if unknown:
        raise LoraError(f"adapter {name!r}: unknown target modules {', '.join(sorted(unknown))} for "
                        f"{spec.architecture} (known: {', '.join(geometry)})")  # fmt: skip
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except Exception as exc:  # safetensors' own error too (a git-lfs pointer in place of the file)
        raise LoraError(f"adapter {name!r}: cannot read {WEIGHTS_FILE} in {str(folder)!r}: {exc}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match[2] not in geometry:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a known module "
                            f"({', '.join(geometry)})")  # fmt: skip
        layer = int(match[1])
        if layer >= spec.num_layers:
            raise LoraError(f"adapter {name!r} adapts layer {layer}; this base model has {spec.num_layers} layers "
                            "(an adapter for another base model)")  # fmt: skip
        pair = halves.setdefault((layer, match[2]), {})
        if match[3] in pair:
            raise LoraError(f"adapter {name!r}: two tensors are lora_{match[3]} of layers.{layer}.{match[2]} ({key!r} "
                            "and another)")  # fmt: skip
        pair[match[3]] = tensor.float()
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = {}
    for (layer, module), pair in sorted(halves.items()):
        _, outputs, inputs = geometry[module]
        a, b = pair.get("A"), pair.get("B")
        where = f"layers.{layer}.{module}"
        if a is None or b is None:
            raise LoraError(f"adapter {name!r}: {where} has lora_{'B' if b is None else 'A'} without its pair")
        if a.shape != (rank, inputs) or b.shape != (outputs, rank):
            raise LoraError(f"adapter {name!r} was made for another base model: {where} has lora_A "
                            f"{list(a.shape)} and lora_B {list(b.shape)}, this model needs [{rank}, {inputs}] and "
                            f"[{outputs}, {rank}]")  # fmt: skip
        modules[layer, module] = (a, b * scaling)
    return LoraAdapter(name, str(folder), rank, scaling, modules)


def lora_rows(seqs, device: torch.device) -> LoraRows | None:
    """The step's rows by adapter slot (ScheduledSeq.lora_slot), in the packer's order: each sequence's tokens, and
    each sampled one's last token (and its proposals' rows); None when every sequence is the base model's."""
    if all(seq.lora_slot < 0 for seq in seqs):
        return None
    rows = [seq.lora_slot for seq in seqs for _ in seq.token_ids]
    sampled = [seq.lora_slot for seq in seqs if seq.do_sample for _ in range(1 + seq.num_draft_tokens)]
    return LoraRows(RowSlots(rows, device), RowSlots(sampled, device))


class RowSlots:
    """Rows' adapter slots: `groups`, (slot, row indices on the device, or None for every row) per adapter, base rows
    left out, for the gathered matmuls; `slots`, a slot per row (-1: base), and on CPU `order`, the adapted rows
    grouped by slot, for the kernels."""

    __slots__ = ("groups", "order", "slots")

    def __init__(self, slots: list[int], device: torch.device) -> None:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        self.groups = [(slot, None if len(rows) == len(slots) else torch.tensor(rows, device=device))
                       for slot, rows in groups.items()]  # fmt: skip
        self.slots = torch.tensor(slots, dtype=torch.int32, device=device)
        self.order = None if device.type != "cpu" else \
            torch.tensor([row for rows in groups.values() for row in rows], dtype=torch.int32)  # fmt: skip


@dataclass(slots=True)
class LoraRows:
    """A step's rows, and its sampled rows, which alone go through the last layer past its K/V."""

    rows: RowSlots
    sampled: RowSlots


class LoraBatch:
    """The rows the model's projections serve now, shared by all its `LoraDelta`s: the forward sets `current` from
    the step's `LoraRows` (None: every row is the base model's)."""

    __slots__ = ("current", "native", "triton")

    def __init__(self, triton, native=None) -> None:
        self.current: RowSlots | None = None
        self.triton = triton  # the triton_lora module on the GPU path
        self.native = native  # the CPU path's native.LoraKernel; with neither, gathered torch matmuls


class LoraDelta:
    """One projection's slots: out += B[slot] (A[slot] x) for each row group of the step (`LoraRows`)."""

    __slots__ = ("_native_weights", "a", "b", "batch", "out_rows", "seg_cols", "segment_rows", "spans")

    def __init__(self, batch: LoraBatch, slots: int, max_rank: int, segments: int, inputs: int,
                 out_rows: tuple[int, int], dtype: torch.dtype, device: torch.device,
                 segment_starts: tuple[int, ...] = (0,)) -> None:  # fmt: skip
        self.batch = batch
        outputs = out_rows[1] - out_rows[0]
        self.a = torch.zeros(slots, segments * max_rank, inputs, dtype=dtype, device=device)
        if device.type == "cpu":  # B^T per slot underneath, rows contiguous along the outputs, as lora_delta.c reads
            self.b = torch.zeros(slots, segments * max_rank, outputs, dtype=dtype).transpose(1, 2)
        else:
            self.b = torch.zeros(slots, outputs, segments * max_rank, dtype=dtype, device=device)
        self.out_rows = out_rows  # [first, last) of the projection's output rows this linear computes
        self.segment_rows = max_rank
        # the column segments of this linear's outputs (q, k, v; gate, up), where each starts, then the end; and per
        # slot and segment the ranks where B is not zero there (`refresh`), which lora_delta.c alone reads
        local = [min(max(start - out_rows[0], 0), outputs) for start in segment_starts]
        self.seg_cols = torch.tensor([*local, outputs], dtype=torch.int32)
        self.spans = torch.zeros(slots, len(local), 2, dtype=torch.int32)
        native = batch.native  # the kernel's view of these tensors, checked once (they are filled in place)
        self._native_weights = None if native is None else native.weights(self.a, self.b.transpose(1, 2), self.spans,
                                                                           self.seg_cols)  # fmt: skip

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base output of x) plus each row's adapter delta, in place."""
        current, triton, native = self.batch.current, self.batch.triton, self.batch.native
        if triton is not None:
            return triton.lora_bgmv(x, y, self.a, self.b, current.slots)
        if native is not None and (len(current.groups) > 1 or current.order.numel() <= native.ROWS_ONE_ADAPTER):
            native(x if x.stride(1) == 1 else x.contiguous(), y, current.order, current.slots, self._native_weights)
            return y
        for slot, rows in current.groups:
            xs = x if rows is None else x.index_select(0, rows)
            delta = torch.matmul(torch.matmul(xs, self.a[slot].t()), self.b[slot].t())
            if rows is None:
                y.add_(delta)
            else:  # a row is in one group only, so a gather, an add and a scatter; index_add_ is slow here
                y.index_copy_(0, rows, y.index_select(0, rows).add_(delta))
        return y

    def refresh(self, slot: int) -> None:
        """Read `spans` for `slot` off its B, after the slot was (re)filled."""
        if self.b.device.type != "cpu":
            return
        nonzero = self.b[slot] != 0  # [outputs, ranks]
        cols = self.seg_cols.tolist()
        for segment in range(len(cols) - 1):
            ranks = nonzero[cols[segment] : cols[segment + 1]].any(dim=0).nonzero()
            self.spans[slot, segment] = torch.tensor([ranks.min() if len(ranks) else 0,
                                                      ranks.max() + 1 if len(ranks) else 0])  # fmt: skip

    def fill(self, slot: int, segment: int, a: torch.Tensor | None, b: torch.Tensor | None, first: int) -> None:
        """Write one module's A [r, in] and B [out, r] (its outputs from row `first` of the projection) into `slot`'s
        segment; None clears it. The rows of B outside this linear's `out_rows` are not its. `refresh` the slot
        after its last fill."""
        cols = slice(segment * self.segment_rows, (segment + 1) * self.segment_rows)
        self.a[slot, cols].zero_()
        self.b[slot, :, cols].zero_()
        if a is None:
            return
        lo, hi = max(first, self.out_rows[0]), min(first + b.shape[0], self.out_rows[1])
        if lo >= hi:
            return
        rank = a.shape[0]
        self.a[slot, cols.start : cols.start + rank] = a.to(self.a.dtype)
        self.b[slot, lo - self.out_rows[0] : hi - self.out_rows[0], cols.start : cols.start + rank] = b[
            lo - first : hi - first
        ].to(self.b.dtype)


def _shard_module(module: str, a: torch.Tensor, b: torch.Tensor, spec, shard) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of a module's A and B: rows of B for column-parallel projections, columns of A for
    row-parallel ones (parallel.py's layout)."""
    d = spec.head_dim
    q_rows, kv_rows, inter = (shard.q_heads[0] * d, shard.q_heads[1] * d), \
        (shard.kv_heads[0] * d, shard.kv_heads[1] * d), shard.inter  # fmt: skip
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": inter, "up_proj": inter}
    cols = {"o_proj": q_rows, "down_proj": inter}
    if module in rows:
        return a, b[rows[module][0] : rows[module][1]]
    if module in cols:
        return a[:, cols[module][0] : cols[module][1]], b
    raise LoraError(f"{module} (a fused checkpoint module) is not supported under tensor parallelism")


class LoraCache:
    """One runner's adapters: read on first use and kept in host memory (least recently used first out past
    `max_cpu_loras`), and its model's `LoraDelta`s filled slot by slot."""

    def __init__(self, spec, layer_spec, shard, max_rank: int, max_cpu_loras: int, share: bool = False) -> None:
        """`share` (rank 0 under tensor parallelism): staged copies are made in shared memory, on the reader thread,
        for the other ranks; each lives there until its slot is filled on every rank."""
        self.spec, self.layer_spec, self.shard, self.share = spec, layer_spec, shard, share
        self.max_rank, self.max_cpu_loras = max_rank, max_cpu_loras
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()  # `read` runs on callers' threads too (checking an adapter as it is added)
        self.deltas: list[dict[str, list[LoraDelta]]] = []  # per layer: projection -> its linears' deltas
        self._reader: ThreadPoolExecutor | None = None  # `stage`'s reads, started on first use
        self._reading: set[tuple[str, str]] = set()  # (name, folder) being read for `stage`
        self._staged: OrderedDict[tuple[str, str], LoraAdapter] = OrderedDict()  # read, waiting for `activate`
        self._failed: dict[tuple[str, str], tuple[float, str]] = {}  # (when, why) a read for `stage` failed

    def _host_copy(self, name: str, path: str) -> LoraAdapter | None:
        """Under the lock: the adapter's copy in host memory, if it was read from this folder."""
        adapter = self.host.get(name)
        return adapter if adapter is not None and adapter.path == str(Path(path)) else None

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter, from host memory or (then kept) from its folder."""
        with self._lock:
            adapter = self._host_copy(name, path)
        if adapter is None:
            adapter = read_adapter(name, path, self.spec, self.max_rank)
            if self.shard is not None:  # every module shards, or the load says which does not
                fused = sorted({module for _, module in adapter.modules} & {"qkv_proj", "gate_up_proj"})
                if fused:
                    raise LoraError(f"adapter {name!r}: {', '.join(fused)} (fused checkpoint modules) are not "
                                    "supported under tensor parallelism")  # fmt: skip
        with self._lock:
            self.host[name] = adapter
            self.host.move_to_end(name)
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        return adapter

    def stage(self, name: str, path: str) -> bool | str:
        """Whether the adapter is read and held for the slot it is about to fill: True; False while it is read from
        its folder on the reader thread (started here); the reason where that read failed (said once, and only for
        STAGE_ERROR_S after it: a later request reads again, should the folder be back). A staged adapter is held
        apart from host memory's eviction until `activate` takes it (at most `max_cpu_loras` of them)."""
        key = (name, str(Path(path)))
        with self._lock:
            if key in self._staged:
                return True
            failed = self._failed.pop(key, None)
            if failed is not None and time.monotonic() - failed[0] <= STAGE_ERROR_S:
                return failed[1]
            if key in self._reading:
                return False
            adapter = self._host_copy(name, path)
            if adapter is not None and not self.share:
                self._hold(key, adapter)
                return True
            if self._reader is None:  # (a host copy to share is copied into shared memory there too)
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="overlap-lora-read")
            self._reading.add(key)
        self._reader.submit(self._read_staged, key)
        return False

    def _read_staged(self, key: tuple[str, str]) -> None:
        try:
            adapter = self.read(*key)
            if self.share:  # a copy as large as the adapter: here, not on the engine's thread nor under the lock
                adapter = adapter.shared()
        except Exception as exc:  # an unreadable folder, or shared memory full (RuntimeError)
            with self._lock:
                self._reading.discard(key)
                self._failed[key] = (time.monotonic(), str(exc))
            return
        with self._lock:
            self._reading.discard(key)
            self._hold(key, adapter)

    def hold(self, adapter: LoraAdapter) -> None:
        """Keep `adapter` (rank 0's copy, on another tensor-parallel rank) for the `activate` that follows."""
        with self._lock:
            self._hold((adapter.name, adapter.path), adapter)

    def _hold(self, key: tuple[str, str], adapter: LoraAdapter) -> None:
        """Under the lock: keep `adapter` for `activate` (the oldest held one goes past `max_cpu_loras`)."""
        self._staged[key] = adapter
        self._staged.move_to_end(key)
        while len(self._staged) > self.max_cpu_loras:
            self._staged.popitem(last=False)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)

    def attach(self, model, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        """Give every layer's projections their (empty) slots, and the model the `LoraBatch` its forward sets."""
        s, d = self.layer_spec, self.layer_spec.head_dim
        qkv_out, hidden = (s.num_heads + 2 * s.num_kv_heads) * d, s.hidden_size
        triton = native = None
        if device.type == "cuda":
            from overlap.engine.model import triton_lora as triton
        elif device.type == "cpu" and dtype in LoraKernel.DTYPES:
            native = lora_kernel()
        model.lora = batch = LoraBatch(triton, native)
        for layer in model.layers:
            q, kv = s.num_heads * d, s.num_kv_heads * d
            projections = {"qkv": [(layer.qkv, (0, qkv_out), hidden, (0, q, q + kv))],
                           "o": [(layer.o, (0, hidden), q, (0,))]}  # fmt: skip
            mlp = layer.mlp
            if hasattr(mlp, "inter"):  # a dense GatedMLP (a sparse block takes no adapters)
                inter = mlp.inter
                ups = (
                    [(mlp.gate_up, (0, 2 * inter), hidden, (0, inter))]
                    if mlp.gate_up is not None
                    else [(mlp.gate, (0, inter), hidden, (0, inter)), (mlp.up, (inter, 2 * inter), hidden, (0, inter))]
                )
                projections |= {"gate_up": ups, "down": [(mlp.down, (0, hidden), inter, (0,))]}
            deltas = {}
            for proj, linears in projections.items():
                deltas[proj] = []
                for linear, out_rows, inputs, starts in linears:
                    linear.lora = LoraDelta(batch, max_loras, self.max_rank, SEGMENTS[proj], inputs, out_rows, dtype,
                                            device, starts)  # fmt: skip
                    deltas[proj].append(linear.lora)
            self.deltas.append(deltas)
        return None

    def activate(self, slot: int, name: str, path: str) -> LoraAdapter:
        """Fill `slot` with the adapter (every module it lacks cleared) and return it; where that fails, the slot is
        left empty."""
        try:
            with self._lock:
                adapter = self._staged.pop((name, str(Path(path))), None)
            if adapter is None:  # not staged (held too long): read here
                adapter = self.read(name, path)
            with torch.inference_mode():  # the slots were made in inference mode
                self._fill(slot, adapter)
            return adapter
        except Exception:
            with torch.inference_mode():
                self._fill(slot, LoraAdapter(name, str(path), 0, 0.0, {}))
            raise

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        geometry = module_geometry(self.layer_spec)
        for index, deltas in enumerate(self.deltas):
            filled: set[tuple[str, int]] = set()
            for module, (proj, segment) in MODULES.items():
                pair = adapter.modules.get((index, module))
                if pair is None or proj not in deltas:
                    continue
                a, b = pair if self.shard is None else _shard_module(module, *pair, self.spec, self.shard)
                for delta in deltas[proj]:
                    delta.fill(slot, segment, a, b, geometry[module][0])
                filled.add((proj, segment))
            for proj, proj_deltas in deltas.items():
                for segment in range(SEGMENTS[proj]):
                    if (proj, segment) not in filled:
                        for delta in proj_deltas:
                            delta.fill(slot, segment, None, None, 0)
                for delta in proj_deltas:
                    delta.refresh(slot)
