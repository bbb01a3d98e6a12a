"""The execution layer: an N-buffered pipeline of model steps (docs/design.md, layer 3).

`num_buffers` steps may be in flight at once. With 1 the executor is synchronous: `submit` runs the forward in
the caller's thread. With 2 or more a worker thread runs forwards in submission order (torch and the simulated
device release the GIL while they compute), so the caller schedules and stages step N+1 while step N runs and
reads back step N-1. The double buffer is a bounded deque of in-flight steps (vLLM v1
`EngineCore.step_with_batch_queue`): `step()` fills it while there is work and waits for the oldest step only
once it is full (or nothing more could be scheduled), so each call hands back one finished step.

Placeholders. A sequence whose last sampled token is still "on the device" (its step has not been read back) can
be scheduled for its next decode step with `token_ids == [PLACEHOLDER_TOKEN]`. The worker substitutes the token
that the sequence's latest step sampled before it runs the forward, so decode never waits for the host to see
the token. The host learns the token one step later, so it applies stop conditions that need the token (EOS,
stop ids) one step late: it must drop what the extra step produced and free that request's KV only once no step
holding it is in flight (`Step` says which step produced what). `max_tokens` needs no token and can be
respected at schedule time.

The launch/wait variant (the simulated device) is in `launch.py`, the CUDA path (streams, events, pinned per-slot
staging, CUDA graphs) in `cuda.py`; `make_executor` in this package's `__init__` picks one.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from overlap.engine.errors import ConfigError
from overlap.engine.execution.busy import BusyTracker
from overlap.engine.types import NONFINITE_TOKEN, PLACEHOLDER_TOKEN, ModelInput, Runner, RunnerOutput

__all__ = [
    "MAX_BUFFERS",
    "PLACEHOLDER_TOKEN",
    "Executor",
    "Step",
    "placeholder_source",
]
T = TypeVar("T")

MAX_BUFFERS = 4
# The worker thread needs the GIL to start each forward. While the engine thread runs Python (scheduling) it gets it
# only when the interpreter's switch interval (default 5 ms, longer than a whole GPU step) forces a hand-over, so
# the executor lowers it to this when it starts a worker (process-wide; the engine owns its process). Measured on
# the simulated 4 ms step with 1.5 ms of host work: device idle ~25% -> ~8% with two buffers on a loaded machine.
WORKER_SWITCH_INTERVAL_S = 0.001
# What a placeholder of a request whose step failed gets (any valid token id would do; its result is dropped).
DISCARDED_TOKEN = 0


@dataclass(slots=True)
class Step:
    """One step through the pipeline, in every executor. Submitted, it waits on `pending` (a Future of the worker
    thread, a launch handle of the runner, the CUDA step's events and buffers); collected, it holds the runner's
    `output`, or the `error` that failed it (its requests finish with ERROR), and the engine postprocesses it."""

    step_id: int
    model_input: ModelInput
    pending: object = None
    output: RunnerOutput | None = None
    error: BaseException | None = None  # set before it reached the device (a launch failure) or when it failed there

    @property
    def busy_s(self) -> float:
        """The step's device busy time (0 for a failed step)."""
        return 0.0 if self.output is None else self.output.busy_s

    def sampled(self) -> list[tuple[str, int]]:
        """(request_id, token) for every sequence that sampled in this step."""
        ids = [seq.request_id for seq in self.model_input.seqs if seq.do_sample]
        return list(zip(ids, self.output.token_ids, strict=True))

    def done(self, output: RunnerOutput | None = None, error: BaseException | None = None) -> Step:
        """This step, collected: with its output, or failed with `error`. What it waited on goes (the CUDA step's
        device tensors are not kept through postprocessing)."""
        self.pending, self.output, self.error = None, output, error
        return self


def placeholder_source(seq, latest: Mapping[str, T]) -> T | None:
    """None for a sequence that carries its tokens; for a placeholder, what `latest` holds for its request (the
    token itself, or where the device keeps it). A placeholder must be a decode's only token and must follow a step
    that sampled for the request; anything else is a scheduling bug, raised as ValueError."""
    if PLACEHOLDER_TOKEN not in seq.token_ids:
        return None
    if seq.token_ids != [PLACEHOLDER_TOKEN]:
        raise ValueError(f"{seq.request_id}: a placeholder must be a decode step's only token")
    source = latest.get(seq.request_id)
    if source is None:
        raise ValueError(f"{seq.request_id}: placeholder but no earlier step sampled a token for it")
    return source


def check_num_buffers(num_buffers: int) -> int:
    if not isinstance(num_buffers, int) or not 1 <= num_buffers <= MAX_BUFFERS:
        raise ConfigError(f"num_buffers must be an integer in 1..{MAX_BUFFERS}, got {num_buffers!r}")
    return num_buffers


class Executor:
    """Runs model steps on `runner` (its `execute`), up to `num_buffers` at once. Not thread-safe: one engine thread
    drives it; the worker thread is its own."""

    def __init__(self, runner: Runner, num_buffers: int = 2, busy: BusyTracker | None = None) -> None:
        self.runner = runner
        self.busy = busy if busy is not None else BusyTracker()
        self._num_buffers = check_num_buffers(num_buffers)
        self._in_flight: deque[Step] = deque()
        self._worker: ThreadPoolExecutor | None = None
        self._next_step_id = 0
        # request_id -> the token its latest executed step sampled. Written by whichever thread runs forwards
        # (only one at a time: the worker, or the caller when synchronous); read there to fill placeholders.
        self._last_token: dict[str, int] = {}
        self._forget_later: set[str] = set()  # finished requests still held by an in-flight step

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def num_buffers(self) -> int:
        return self._num_buffers

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def is_full(self) -> bool:
        return len(self._in_flight) >= self._num_buffers

    def set_num_buffers(self, num_buffers: int) -> None:
        """Takes effect at once for new steps; steps already in flight finish in order (fewer buffers simply keep
        the deque "full" until enough of them have been collected)."""
        self._num_buffers = check_num_buffers(num_buffers)

    def in_flight_request_ids(self) -> set[str]:
        """Requests that some submitted, not yet collected step holds (their KV must stay allocated)."""
        return {seq.request_id for step in self._in_flight for seq in step.model_input.seqs}

    # -- the pipeline --------------------------------------------------------------------------------------------
    def submit(self, model_input: ModelInput) -> int:
        """Start a step; returns its id. The deque must not be full (`collect` first)."""
        assert not self.is_full, f"submit with {self.num_in_flight} of {self._num_buffers} buffers in flight"
        step_id = self._next_step_id
        self._next_step_id += 1
        if self._num_buffers == 1:
            future: Future = Future()
            try:
                future.set_result(self._run(model_input))
            except BaseException as exc:  # handed to the caller with the step, as the worker would
                future.set_exception(exc)
        else:
            if self._worker is None:
                if sys.getswitchinterval() > WORKER_SWITCH_INTERVAL_S:
                    sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-device")
            future = self._worker.submit(self._run, model_input)
        self._in_flight.append(Step(step_id, model_input, future))
        return step_id

    def oldest_done(self) -> bool:
        return bool(self._in_flight) and self._in_flight[0].pending.done()

    def collect(self, block: bool = True) -> Step | None:
        """The oldest in-flight step, done (None if none is in flight, or if `block` is False and it has not
        finished). A failed forward comes back as `Step.error`, never raised."""
        if not self._in_flight or (not block and not self._in_flight[0].pending.done()):
            return None
        step = self._in_flight.popleft()
        exc = step.pending.exception()  # waits
        self._forget_released()
        if exc is not None:
            return step.done(error=exc)
        return step.done(step.pending.result())

    def step(self, schedule: Callable[[], ModelInput | None]) -> Step | None:
        """One engine step: schedule and submit steps while a buffer is free (`schedule` returns None when there is
        nothing to run), then return the oldest step, waiting for it if it has not finished. So each call returns
        one step's result while `num_buffers - 1` later steps keep the device busy; None only when nothing is in
        flight at all."""
        while not self.is_full:
            start = time.perf_counter()
            model_input = schedule()
            self.busy.record_host("schedule", time.perf_counter() - start)
            if model_input is None or not model_input.seqs:
                if not self._in_flight:
                    self.busy.pause()  # no work: the coming gap is not pipeline overhead
                break
            self.submit(model_input)
        return self.collect(block=True)

    def drain(self) -> list[Step]:
        """Wait for every in-flight step, oldest first (a step boundary for reconfiguration)."""
        results = []
        while self._in_flight:
            results.append(self.collect(block=True))
        return results

    def forget(self, request_ids) -> None:
        """Drop finished requests' device-side tokens: at once, or when the last in-flight step holding the
        request has been collected (that step still writes its token)."""
        ids = set(request_ids)
        if not ids:
            return
        held = ids & self.in_flight_request_ids() if self._in_flight else set()
        for request_id in ids - held:
            self._drop_device_token(request_id)
        self._forget_later |= held

    def _drop_device_token(self, request_id: str) -> None:
        self._last_token.pop(request_id, None)
        self.runner.forget_request(request_id)

    def _forget_released(self) -> None:
        """After a collect: forget the deferred requests that no in-flight step holds any more."""
        if self._forget_later:
            held = self.in_flight_request_ids()
            for request_id in self._forget_later - held:
                self._drop_device_token(request_id)
            self._forget_later &= held

    def close(self) -> list[Step]:
        """Drain and stop the worker thread; returns the drained results. A later submit starts a new worker."""
        results = self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        return results

    # -- the "device" side -----------------------------------------------------------------------------------------
    def _run(self, model_input: ModelInput) -> RunnerOutput:
        batch = self._fill_placeholders(model_input)
        try:
            output = self.runner.execute(batch)
        except BaseException:
            # Tokens these sequences sampled earlier must never feed a later placeholder as if they were new.
            self._discard_tokens(seq.request_id for seq in batch.seqs)
            raise
        self.busy.record_interval(*output.busy)
        sampled = [seq.request_id for seq in batch.seqs if seq.do_sample]
        if len(sampled) != len(output.token_ids):
            self._discard_tokens(seq.request_id for seq in batch.seqs)
            raise RuntimeError(f"runner returned {len(output.token_ids)} tokens for {len(sampled)} sampling sequences")
        for request_id, token in zip(sampled, output.token_ids, strict=True):
            self._last_token[request_id] = DISCARDED_TOKEN if token == NONFINITE_TOKEN else token
        return output

    def _discard_tokens(self, request_ids) -> None:
        """These requests' step failed: postprocessing finishes them with ERROR, but a later step for them may be in
        flight already. Its placeholders get DISCARDED_TOKEN (what it samples for them is dropped), so that step
        still runs for the other requests in it."""
        for request_id in request_ids:
            self._last_token[request_id] = DISCARDED_TOKEN

    def _fill_placeholders(self, model_input: ModelInput) -> ModelInput:
        seqs = model_input.seqs
        if not any(PLACEHOLDER_TOKEN in seq.token_ids for seq in seqs):
            return model_input
        # The step's own ScheduledSeq objects get the token (a fresh list: the scheduler's list is never mutated),
        # so postprocessing sees what was fed; a copy per sequence would cost the device ~2 us each.
        for seq in seqs:
            token = placeholder_source(seq, self._last_token)
            if token is not None:
                seq.token_ids = [token]
        return model_input
