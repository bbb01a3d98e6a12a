"""A simulated device: a model runner whose forward takes the time a cost model gives.

It keeps the real runner's contract (the `Runner` protocol of `overlap.engine.types`) so the engine's pipeline can be
measured and tested on any machine:

- Time: a step with N tokens takes `fixed_s + per_token_s * N` (`CostModel`, from flags or a measured profile).
  The runner waits for it without holding the GIL, as a CUDA stream or a torch forward lets the host run on.
  Every forward's busy interval `(start, end)` on `time.perf_counter()` is recorded exactly.
- Two ways to run: `execute()` is a synchronous forward that the executor's worker thread calls (the CPU path);
  with `asynchronous=True` the runner also offers `launch()` / `wait()` like a CUDA stream (steps queue up and
  run back to back on the device's own clock, independent of the GIL), driven from the engine thread by
  `AsyncExecutor` (the CUDA path's structure).
- Tokens: deterministic and history-dependent. The runner keeps a paged "KV pool" in which each slot holds a
  rolling hash of the sequence up to that position, written and read through the block table exactly as real K/V
  would be. The sampled token is a function of the last position's hash, so a scheduler that feeds a wrong token,
  a wrong position or a block that was freed and reused too early produces different tokens than
  `reference_tokens()`, the same computation done serially.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from overlap.engine.errors import ConfigError
from overlap.engine.types import PLACEHOLDER_TOKEN, ModelInput, Runner, RunnerOutput

_MASK = (1 << 64) - 1
_SEED = 0x243F6A8885A308D3  # the hash before position 0


def _mix(h: int, token: int) -> int:
    """One step of a 64-bit rolling hash (splitmix64 finaliser over the previous hash and the token)."""
    z = (h ^ (token + 0x9E3779B97F4A7C15)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _token_from_hash(h: int, vocab_size: int) -> int:
    return (h >> 11) % vocab_size


# An OS sleep overshoots by ~0.1-0.2 ms on a busy machine, which would show up as idle time between simulated
# steps; so sleep until this long before the deadline, then yield in a loop (each `sleep(0)` frees the GIL).
_SPIN_MARGIN_S = 0.0003


def _wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter() - _SPIN_MARGIN_S
    if remaining > 0:
        time.sleep(remaining)
    while time.perf_counter() < deadline:
        time.sleep(0)


@dataclass(slots=True)
class SimLaunch:
    batch: ModelInput
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Device time of one step: `fixed_s + per_token_s * num_tokens`."""

    fixed_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed_s) and math.isfinite(self.per_token_s)):
            raise ConfigError("cost model parameters must be finite")
        if self.fixed_s < 0 or self.per_token_s < 0:
            raise ConfigError(f"cost model parameters must be >= 0, got {self.fixed_s}, {self.per_token_s}")

    def step_s(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens

    @classmethod
    def for_step(cls, step_ms: float, batch: int, per_token_us: float = 10.0) -> CostModel:
        """The cost model whose decode step at `batch` sequences takes `step_ms`."""
        fixed_s = step_ms / 1000 - batch * per_token_us / 1e6
        if fixed_s < 0:
            raise ConfigError(f"{batch} tokens at {per_token_us} us each already exceed a {step_ms} ms step")
        return cls(fixed_s=fixed_s, per_token_s=per_token_us / 1e6)

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]]) -> CostModel:
        """Least-squares fit of (num_tokens, seconds) samples, e.g. a real runner's measured forward times."""
        points = list(samples)
        if len({n for n, _ in points}) < 2:
            raise ConfigError("fitting a cost model needs samples at two or more token counts")
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        var_n = sum((n - mean_n) ** 2 for n, _ in points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var_n
        slope = max(slope, 0.0)
        return cls(fixed_s=max(mean_t - slope * mean_n, 0.0), per_token_s=slope)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a profile written by `save` ({"fixed_s": ..., "per_token_s": ...})."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(fixed_s=float(data["fixed_s"]), per_token_s=float(data["per_token_s"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read cost profile {path}: {exc}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)) + "\n")


class SimRunner(Runner):
    """A runner with the real contract whose forward sleeps for the cost model's time."""

    def __init__(
        self,
        cost: CostModel,
        *,
        vocab_size: int = 8192,
        block_size: int = 16,
        num_kv_blocks: int = 4096,
        max_model_len: int = 2048,
        eos_token_ids: tuple[int, ...] = (2,),
        max_intervals: int = 1 << 16,
        asynchronous: bool = False,
    ) -> None:
        if vocab_size < 2 or block_size < 1 or num_kv_blocks < 1 or max_model_len < 2:
            raise ConfigError("SimRunner needs vocab_size >= 2, block_size >= 1, num_kv_blocks >= 1")
        self.cost = cost
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        # asynchronous: behave like a GPU stream (launch / wait, see `launch`); the executor then launches from the
        # engine thread and needs no worker thread (make_executor picks AsyncExecutor).
        self.step_mode = "launch" if asynchronous else "thread"
        self._device_free_at = 0.0
        self._device_last_token: dict[str, int] = {}  # request -> its latest sampled token, "in device memory"
        # Each KV slot holds (position, hash of tokens 0..position); None = never written.
        self._kv: list[tuple[int, int] | None] = [None] * (num_kv_blocks * block_size)
        self.busy_intervals: deque[tuple[float, float]] = deque(maxlen=max_intervals)
        self.num_steps = 0
        self.busy_s_total = 0.0

    @classmethod
    def from_config(cls, config, cost: CostModel, **kwargs) -> SimRunner:
        """Sized like the real runner would be for an `EngineConfig` (an explicit `num_kv_blocks` wins)."""
        return cls(
            cost,
            block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks or 4096,
            max_model_len=config.max_seq_len,
            **kwargs,
        )

    @classmethod
    def for_model(cls, config, model_dir: Path) -> SimRunner:
        """The simulated device `config.simulated_device` asks for, in the shape of the model in `model_dir`: its
        vocabulary, EOS ids, sampling defaults and context length (the weights are never read)."""
        from overlap.engine.model.model_spec import read_spec

        spec = read_spec(model_dir)
        cost = CostModel(float(config.simulated_device["fixed_s"]), float(config.simulated_device["per_token_s"]))
        runner = cls.from_config(
            config,
            cost,
            vocab_size=spec.vocab_size,
            eos_token_ids=tuple(spec.eos_token_ids),
            asynchronous=True,  # a device that runs on its own clock, like a GPU
        )
        runner.max_model_len = min(config.max_seq_len, spec.rope_context_cap or spec.max_position_embeddings)
        runner.sampling_defaults = spec.sampling_defaults
        runner.model_dir = Path(model_dir)
        return runner

    def execute(self, batch: ModelInput) -> RunnerOutput:
        start = time.perf_counter()
        deadline = start + self.cost.step_s(batch.num_tokens)
        sampled = [self._run_seq(seq) for seq in batch.seqs]
        # The device is done at the deadline (or when the token bookkeeping is, if that took longer). Waking up
        # later, because the host thread held the GIL, is the host's lateness, not device time.
        end = max(deadline, time.perf_counter())
        _wait_until(end)
        self.busy_intervals.append((start, end))
        self.busy_s_total += end - start
        self.num_steps += 1
        return RunnerOutput([token for token in sampled if token is not None], (start, end))

    # -- the asynchronous device: a stream of steps in virtual time -------------------------------------------------
    def launch(self, batch: ModelInput) -> SimLaunch:
        """Queue a step, as a CUDA launch does: it starts when the device has finished the steps before it (or now)
        and runs for the cost model's time, whatever the host threads do meanwhile. Returns at once."""
        start = max(time.perf_counter(), self._device_free_at)
        end = start + self.cost.step_s(batch.num_tokens)
        self._device_free_at = end
        self.busy_intervals.append((start, end))
        self.busy_s_total += end - start
        self.num_steps += 1
        return SimLaunch(batch, start, end)

    def wait(self, launched: SimLaunch) -> RunnerOutput:
        """Wait (without the GIL) until the step is done and return its tokens. Steps must be waited for in launch
        order; a decode with `PLACEHOLDER_TOKEN` gets the token its sequence sampled last, as a device-side gather
        would."""
        _wait_until(launched.end)
        sampled = []
        try:
            for seq in launched.batch.seqs:
                if PLACEHOLDER_TOKEN in seq.token_ids:
                    token = self._device_last_token.get(seq.request_id)
                    if seq.token_ids != [PLACEHOLDER_TOKEN] or token is None:
                        raise ValueError(f"{seq.request_id}: placeholder with no token sampled before it")
                    seq.token_ids = [token]
                token = self._run_seq(seq)
                if token is not None:
                    sampled.append((seq.request_id, token))
        except Exception:
            for seq in launched.batch.seqs:  # never feed these sequences a stale token later
                self._device_last_token.pop(seq.request_id, None)
            raise
        self._device_last_token.update(sampled)
        return RunnerOutput([token for _, token in sampled], (launched.start, launched.end))

    def forget_request(self, request_id: str) -> None:
        self._device_last_token.pop(request_id, None)

    def _run_seq(self, seq) -> int | None:
        if not seq.token_ids:
            raise ValueError(f"{seq.request_id}: a scheduled sequence needs at least one token")
        end_pos = seq.start_pos + len(seq.token_ids)
        if end_pos > self.max_model_len:
            raise ValueError(f"{seq.request_id}: position {end_pos - 1} is past max_model_len {self.max_model_len}")
        if len(seq.block_table) * self.block_size < end_pos:
            raise ValueError(f"{seq.request_id}: block table covers {len(seq.block_table)} blocks, needs {end_pos}")
        h = _SEED
        if seq.start_pos > 0:
            h = self._read(seq, seq.start_pos - 1)
        for offset, token in enumerate(seq.token_ids):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"{seq.request_id}: token id {token} outside the vocabulary")
            h = _mix(h, token)
            self._kv[self._slot(seq, seq.start_pos + offset)] = (seq.start_pos + offset, h)
        return _token_from_hash(h, self.vocab_size) if seq.do_sample else None

    def _slot(self, seq, pos: int) -> int:
        block = seq.block_table[pos // self.block_size]
        if not 0 <= block < self.num_kv_blocks:
            raise ValueError(f"{seq.request_id}: block id {block} outside the pool of {self.num_kv_blocks}")
        return block * self.block_size + pos % self.block_size

    def _read(self, seq, pos: int) -> int:
        entry = self._kv[self._slot(seq, pos)]
        if entry is None or entry[0] != pos:
            raise ValueError(f"{seq.request_id}: KV slot for position {pos} holds {entry}, not that position")
        return entry[1]

    def reference_tokens(self, prompt: list[int], num_tokens: int) -> list[int]:
        """What greedy generation of `num_tokens` after `prompt` yields, computed serially without the pool."""
        h = _SEED
        for token in prompt:
            h = _mix(h, token)
        out = []
        for _ in range(num_tokens):
            token = _token_from_hash(h, self.vocab_size)
            out.append(token)
            h = _mix(h, token)
        return out
