"""A closed-loop decode workload that drives the `Executor` directly, with a controlled host cost per step.

It isolates the execution layer from the real scheduler: `batch` requests decode side by side (a finished one is
replaced by the next), every step spends `host_ms` of pure-Python CPU time (holding the GIL, as scheduling and
staging do) before it is submitted, and postprocessing spends `postprocess_ms`. It follows the executor's rules
for overlap: decodes are scheduled with placeholders while their previous token is in flight, `max_tokens` is
respected at schedule time, EOS is seen one step late (whatever the extra step produced is dropped) and a
request's KV blocks are returned only once no step holding them is in flight.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from overlap.engine.execution import Executor, Step, make_executor
from overlap.engine.types import PLACEHOLDER_TOKEN, ModelInput, SamplingParams, ScheduledSeq


def spin(seconds: float) -> None:
    """Busy CPU work in Python for `seconds` (holds the GIL like real scheduling code)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass(slots=True)
class LoadRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    blocks: list[int]
    output: list[int] = field(default_factory=list)  # tokens the host has read back
    num_sampling_scheduled: int = 0  # steps scheduled that sample a token for it (prefill + decodes)
    num_in_flight: int = 0  # submitted steps holding it, not yet collected
    finished: bool = False


@dataclass(slots=True)
class LoadStats:
    num_steps: int = 0
    num_tokens: int = 0  # tokens delivered to requests
    num_discarded: int = 0  # tokens sampled by an extra step after a stop condition, dropped
    num_finished: int = 0
    host_s: float = 0.0  # schedule + stage + postprocess time on the host thread
    schedule_s: list[float] = field(default_factory=list)  # per schedule() call
    postprocess_s: list[float] = field(default_factory=list)  # per postprocess() call


class DecodeLoad:
    """`num_requests` requests with `prompt_len`-token prompts and `max_tokens` outputs, `batch` at a time."""

    def __init__(
        self,
        executor: Executor,
        *,
        batch: int,
        num_requests: int,
        prompt_len: int,
        max_tokens: int,
        host_ms: float = 0.0,
        postprocess_ms: float = 0.0,
        spike_ms: float | None = None,
        spike_every: int = 4,
        eos_token_id: int | None = None,
        use_placeholders: bool = True,
        seed: int = 0,
    ) -> None:
        runner = executor.runner
        self.executor = executor
        self.batch = batch
        self.host_s = host_ms / 1000
        # every `spike_every`-th schedule() spends `spike_ms` instead (a host hiccup: GC, a burst of arrivals)
        self.spike_s = None if spike_ms is None else spike_ms / 1000
        self.spike_every = spike_every
        self._num_schedules = 0
        self.postprocess_s = postprocess_ms / 1000
        self.eos_token_id = eos_token_id
        self.use_placeholders = use_placeholders
        self.block_size = runner.block_size
        self.blocks_per_request = -(-(prompt_len + max_tokens) // self.block_size)
        if self.blocks_per_request * batch > runner.num_kv_blocks:
            raise ValueError(
                f"{batch} requests need {self.blocks_per_request * batch} KV blocks; the pool has "
                f"{runner.num_kv_blocks}"
            )
        self.free_blocks = list(range(runner.num_kv_blocks))
        self.num_kv_blocks = runner.num_kv_blocks
        rng = random.Random(seed)
        # Output lengths vary (max_tokens/2 .. max_tokens) so requests finish and get replaced at different steps.
        self.pending = [
            (
                f"r{i}",
                [rng.randrange(3, runner.vocab_size) for _ in range(prompt_len)],
                rng.randint(max(1, max_tokens // 2), max_tokens),
            )
            for i in range(num_requests)
        ]
        self.pending.reverse()  # pop() from the end keeps arrival order
        self.running: dict[str, LoadRequest] = {}
        self.done: dict[str, LoadRequest] = {}
        self.stats = LoadStats()
        self._sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.running)

    def schedule(self) -> ModelInput | None:
        start = time.perf_counter()
        self._num_schedules += 1
        spiking = self.spike_s is not None and self._num_schedules % self.spike_every == 0
        spin(self.spike_s if spiking else self.host_s)
        while self.pending and len(self.running) < self.batch and len(self.free_blocks) >= self.blocks_per_request:
            request_id, prompt, max_tokens = self.pending.pop()
            # a run of consecutive ids where the free list allows, as the block manager hands out (the runner
            # reads such a run in place)
            blocks = self.free_blocks[: self.blocks_per_request]
            del self.free_blocks[: self.blocks_per_request]
            self.running[request_id] = LoadRequest(request_id, prompt, max_tokens, blocks)
        seqs = []
        for req in self.running.values():
            seq = self._next_seq(req)
            if seq is not None:
                req.num_sampling_scheduled += 1
                req.num_in_flight += 1
                seqs.append(seq)
        # prefills first, then decodes (the runner contract's order)
        seqs.sort(key=lambda s: len(s.token_ids) == 1 and s.start_pos > 0)
        elapsed = time.perf_counter() - start
        self.stats.host_s += elapsed
        self.stats.schedule_s.append(elapsed)
        return ModelInput(seqs) if seqs else None

    def _next_seq(self, req: LoadRequest) -> ScheduledSeq | None:
        if req.finished or req.num_sampling_scheduled >= req.max_tokens:
            return None  # max_tokens is known at schedule time; EOS only once read back
        if req.num_sampling_scheduled == 0:
            return ScheduledSeq(req.request_id, list(req.prompt), 0, req.blocks, True, self._sampling, 0)
        if len(req.output) < req.num_sampling_scheduled:  # the last token is still on the device
            if not self.use_placeholders:
                return None
            token = PLACEHOLDER_TOKEN
        else:
            token = req.output[-1]
        pos = len(req.prompt) + req.num_sampling_scheduled - 1
        return ScheduledSeq(req.request_id, [token], pos, req.blocks, True, self._sampling, req.num_sampling_scheduled)

    def postprocess(self, result: Step) -> None:
        start = time.perf_counter()
        if result.error is not None:
            raise RuntimeError(f"step {result.step_id} failed") from result.error
        self.stats.num_steps += 1
        for seq in result.model_input.seqs:
            self.running[seq.request_id].num_in_flight -= 1
        for request_id, token in result.sampled():
            req = self.running[request_id]
            if req.finished:
                self.stats.num_discarded += 1  # sampled after EOS by a step already in flight
                continue
            req.output.append(token)
            self.stats.num_tokens += 1
            if token == self.eos_token_id or len(req.output) >= req.max_tokens:
                req.finished = True
        released = [r for r in self.running.values() if r.finished and r.num_in_flight == 0]
        for req in released:
            del self.running[req.request_id]
            self.free_blocks.extend(req.blocks)
            self.done[req.request_id] = req
            self.stats.num_finished += 1
        self.executor.forget(r.request_id for r in released)
        spin(self.postprocess_s)
        elapsed = time.perf_counter() - start
        self.stats.host_s += elapsed
        self.stats.postprocess_s.append(elapsed)

    def run(self, max_steps: int | None = None, max_seconds: float | None = None) -> LoadStats:
        """Drive the executor until every request finished (or a limit is hit; then drain)."""
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds
        while self.has_work or self.executor.num_in_flight:
            if (max_steps is not None and self.stats.num_steps >= max_steps) or (
                deadline is not None and time.perf_counter() >= deadline
            ):
                break
            result = self.executor.step(self.schedule if self.has_work else lambda: None)
            if result is not None:
                self.postprocess(result)
        for result in self.executor.drain():
            self.postprocess(result)
        return self.stats


@dataclass(slots=True)
class OverlapResult:
    """One configuration's measurement. Host = the engine thread's schedule + stage + postprocess time."""

    num_buffers: int
    num_steps: int
    host_ms_per_step: float
    device_ms_per_step: float
    idle_share: float  # 1 - device busy time / elapsed time, from the recorded busy intervals
    predicted_idle_share: float  # the arithmetic from the two measured costs (see `predicted_idle_share`)
    tokens_per_s: float
    idle_gap_p50_ms: float
    idle_gap_p99_ms: float


def predicted_idle_share(num_buffers: int, host_s: list[float], device_s: float) -> float:
    """The device idle share an ideal pipeline would have, given each cycle's host time and a device step time.

    Each cycle the host does its work (schedule + stage + postprocess), submits a step that starts when both it and
    the device are ready, and waits for the oldest step only when `num_buffers` are in flight. With constant host
    time C and device time D that gives C / (C + D) for one buffer and 1 - D / max(C, D) for two or more; with
    uneven host times, more buffers absorb the slow cycles.
    """
    if not host_s:
        return 0.0
    t = 0.0  # host clock
    device_free = 0.0
    first_start = None
    in_flight: deque[float] = deque()
    for host in host_s:
        t += host
        start = max(t, device_free)
        first_start = start if first_start is None else first_start
        device_free = start + device_s
        in_flight.append(device_free)
        if len(in_flight) >= num_buffers:
            t = max(t, in_flight.popleft())
    elapsed = device_free - first_start
    return 1 - len(host_s) * device_s / elapsed if elapsed > 0 else 0.0


def measure_overlap(
    runner,
    num_buffers: int,
    *,
    batch: int,
    steps: int,
    host_ms: float,
    warmup_steps: int = 5,
    prompt_len: int = 8,
    max_tokens: int = 256,
    eos_token_id: int | None = None,
    spike_ms: float | None = None,
    spike_every: int = 4,
) -> OverlapResult:
    """Run `DecodeLoad` on `runner` with `num_buffers`: a warm-up, then `steps` measured steps."""
    from overlap.engine.execution.busy import BusyTracker

    executor = make_executor(runner, num_buffers)
    num_requests = batch * (2 + (warmup_steps + steps) * 2 // max(1, max_tokens))
    load = DecodeLoad(
        executor,
        batch=batch,
        num_requests=num_requests,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        host_ms=host_ms,
        spike_ms=spike_ms,
        spike_every=spike_every,
        eos_token_id=eos_token_id,
    )
    try:
        load.run(max_steps=warmup_steps)
        executor.busy = BusyTracker(window_s=float("inf"))
        load.stats = LoadStats()
        start = time.perf_counter()
        stats = load.run(max_steps=steps)
        elapsed = time.perf_counter() - start
    finally:
        executor.close()
    snap = executor.busy.snapshot()
    host_s = stats.host_s / max(stats.num_steps, 1)
    device_s = snap.busy_s / max(snap.num_steps, 1)
    return OverlapResult(
        num_buffers=num_buffers,
        num_steps=stats.num_steps,
        host_ms_per_step=1000 * host_s,
        device_ms_per_step=1000 * device_s,
        idle_share=1 - snap.busy_ratio if snap.num_steps else 1.0,
        predicted_idle_share=predicted_idle_share(
            num_buffers, [a + b for a, b in zip(stats.schedule_s, stats.postprocess_s, strict=False)], device_s
        ),
        tokens_per_s=stats.num_tokens / elapsed if elapsed > 0 else 0.0,
        idle_gap_p50_ms=snap.idle_gap_ms["p50"],
        idle_gap_p99_ms=snap.idle_gap_ms["p99"],
    )
