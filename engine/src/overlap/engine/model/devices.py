"""What a runner runs on: the device, the dtype, the attention backend, and the size of its KV pool."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from overlap.engine.batching.window_blocks import WindowBlocks
from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError, ModelLoadError
from overlap.engine.model.model_spec import ModelSpec, blocks_for_bytes, kv_bytes_per_token

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 1 << 30  # default CPU pool: what max_num_seqs full-length sequences need, at most 1 GiB


def pick_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank` (GPU `rank` on CUDA)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but torch sees no CUDA device")
    if name == "cuda" and rank:
        if rank >= torch.cuda.device_count():
            raise ConfigError(f"tensor-parallel rank {rank} needs GPU {rank}; torch sees {torch.cuda.device_count()}")
        return torch.device("cuda", rank)
    return torch.device(name)


def pick_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype, except that an fp32 (or undeclared) checkpoint runs in bf16 on CUDA, as vLLM
    does; on CPU an undeclared one stays fp32."""
    if name == "auto":
        name = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
        if device.type == "cuda" and name == "float32":
            name = "bfloat16"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r} (float32, bfloat16, float16)")
    return DTYPES[name]


def pick_attention(requested: str, device: torch.device, cpu_paths: bool) -> str:
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


def kv_pool_blocks(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                   max_model_len: int) -> int:  # fmt: skip
    """Blocks of the KV pool: `num_kv_blocks` when set; on CUDA `kv_cache_ratio` of the free memory; on CPU what
    max_num_seqs full-length sequences need, within CPU_KV_BUDGET_BYTES. At least one full-length sequence."""
    per_token = kv_bytes_per_token(spec, dtype)
    block_size = config.block_size
    min_blocks = -(-max_model_len // block_size)
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        blocks = blocks_for_bytes(free * config.kv_cache_ratio, block_size, per_token)
    else:
        wanted = -(-config.max_num_seqs * max_model_len // block_size)
        blocks = max(min(wanted, blocks_for_bytes(CPU_KV_BUDGET_BYTES, block_size, per_token)), min_blocks)
    if blocks < min_blocks:
        raise ConfigError(
            f"the KV pool holds {blocks} blocks of {block_size} tokens, fewer than one sequence of "
            f"max_seq_len {max_model_len} needs ({min_blocks}); raise num_kv_blocks/kv_cache_ratio or lower max_seq_len"
        )
    return blocks


@dataclass(frozen=True, slots=True)
class KvPoolSplit:
    """The KV pool of a model that mixes sliding-window and full-attention layers, in two parts with their own block
    ids: the full layers hold every position, the sliding ones only their window (batching/window_blocks.py)."""

    num_full_blocks: int
    num_window_blocks: int  # usable; the sliding layers' pool holds one more, the null block
    window: int
    num_full_layers: int
    num_window_layers: int
    num_uniform_blocks: int  # what one pool for every layer would hold in the same bytes

    def describe(self, block_size: int) -> str:
        tokens = self.num_full_blocks * block_size
        return (f"KV pool: {self.num_full_blocks} blocks of {block_size} tokens for {self.num_full_layers} full "
                f"layers and {self.num_window_blocks} for {self.num_window_layers} sliding layers (window "
                f"{self.window}): {tokens} tokens, {tokens / (self.num_uniform_blocks * block_size):.2f}x one pool for "
                "every layer in the same bytes")  # fmt: skip


def split_kv_pool(config: EngineConfig, spec: ModelSpec, num_blocks: int) -> KvPoolSplit | None:
    """Share the bytes of `num_blocks` blocks of every layer between a model's full and sliding layers (None for a
    model that does not mix them). The sliding layers get what max_num_seqs sequences at once need (their window
    and a step's tokens each, `WindowBlocks.max_blocks_per_seq`), or `num_blocks` if that is fewer; the bytes they
    leave go to the full layers, so the pool holds more tokens."""
    windows = {w for w in spec.layer_windows if w is not None}
    num_window_layers = sum(1 for w in spec.layer_windows if w is not None)
    num_full_layers = spec.num_layers - num_window_layers
    if not windows or num_full_layers == 0:
        return None
    if len(windows) > 1:
        raise ModelLoadError(f"sliding layers with different windows {sorted(windows)} are not supported")
    (window,) = windows
    bs = config.block_size
    wanted = WindowBlocks.blocks_for(window, bs, config.max_num_seqs, config.max_num_batched_tokens)
    num_window = min(num_blocks, wanted)
    # every layer's block has the same bytes: the blocks the sliding layers leave go to the full ones
    num_full = num_blocks + (num_blocks - num_window) * num_window_layers // num_full_layers
    return KvPoolSplit(num_full, num_window, window, num_full_layers, num_window_layers, num_blocks)
