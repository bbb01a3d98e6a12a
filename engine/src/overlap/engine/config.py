"""The engine's one configuration object, validated at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from overlap.engine.errors import ConfigError

# Knobs that `Engine.reconfigure()` may change while the engine runs (applied at a step boundary).
LIVE_KNOBS = frozenset({"max_num_seqs", "max_num_batched_tokens", "num_buffers", "aging_s", "default_timeout_s"})


@dataclass(slots=True)
class EngineConfig:
    model: str = ""  # a local Hugging Face model folder; "" means the tiny default model (built on first use)
    dtype: str = "float32"  # float32 | bfloat16 | auto (the checkpoint's own)
    device: str = "cpu"  # cpu | cuda | auto
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    seed: int = 0

    # KV pool: allocated once at start-up. On CUDA sized from kv_cache_ratio of free device memory; on CPU
    # (or when set) num_kv_blocks wins.
    block_size: int = 16
    kv_cache_ratio: float = 0.7
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    # Batch assembly (layer 2).
    max_seq_len: int = 2048  # prompt + output; capped by the model's max_position_embeddings
    max_num_seqs: int = 64  # the "max batch size"
    max_num_batched_tokens: int = 2048  # per-step token budget
    enable_chunked_prefill: bool = True

    # Batching policy (overlap.engine.batching.policies): continuous (default) | serial | fixed_window | dynamic,
    # with its arguments, e.g. {"window_ms": 50} or {"max_batch": 8, "max_wait_ms": 150}.
    batching: str = "continuous"
    batching_args: dict[str, float] = field(default_factory=dict)

    # Request management (layer 1).
    queue_policy: str = "priority"  # priority (levels + aging) | fifo
    num_priority_levels: int = 3  # 0 is the highest
    aging_s: float = 5.0  # a request waiting longer than this moves up one level
    default_timeout_s: float | None = None  # queued longer than this -> finished with reason "timeout"

    # Execution (layer 3).
    num_buffers: int = 2  # steps in flight: 1 = synchronous, 2 = double buffering (1..4)
    adaptive_buffers: bool = False  # let the engine pick num_buffers from measured host vs device time

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        check(
            self.dtype in ("float32", "bfloat16", "auto"),
            f"dtype must be float32|bfloat16|auto, got {self.dtype!r}",
        )
        check(self.device in ("cpu", "cuda", "auto"), f"device must be cpu|cuda|auto, got {self.device!r}")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        check(
            self.block_size in (8, 16, 32, 64, 128),
            f"block_size must be a power of two in 8..128, got {self.block_size}",
        )
        check(0 < self.kv_cache_ratio <= 0.95, f"kv_cache_ratio must be in (0, 0.95], got {self.kv_cache_ratio}")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        check(self.max_seq_len >= 2, f"max_seq_len must be >= 2, got {self.max_seq_len}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_seq_len,
            "without chunked prefill, max_num_batched_tokens must be >= max_seq_len (a prompt must fit one step)",
        )
        check(
            self.batching in ("continuous", "serial", "fixed_window", "dynamic"),
            f"batching must be continuous|serial|fixed_window|dynamic, got {self.batching!r}",
        )
        check(
            self.queue_policy in ("priority", "fifo"),
            f"queue_policy must be priority|fifo, got {self.queue_policy!r}",
        )
        check(1 <= self.num_priority_levels <= 8, "num_priority_levels must be in 1..8")
        check(self.aging_s > 0, f"aging_s must be > 0, got {self.aging_s}")
        check(self.default_timeout_s is None or self.default_timeout_s > 0, "default_timeout_s must be > 0")
        check(1 <= self.num_buffers <= 4, f"num_buffers must be in 1..4, got {self.num_buffers}")
        check(isinstance(self.adaptive_buffers, bool), "adaptive_buffers must be true or false")

    def replace(self, **changes) -> EngineConfig:
        """A validated copy with `changes` applied."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown engine config keys: {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
