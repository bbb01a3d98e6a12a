"""What a runner runs on: the device, the dtype, the attention backend, and the size of its KV pool."""

from __future__ import annotations

import logging
import os

import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError, ModelLoadError
from overlap.engine.model.loader import ModelSpec, blocks_for_bytes, kv_bytes_per_token

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
