"""The execution layer's CUDA path: the same N-buffered pipeline as `Executor`, with no worker thread.

Not run on a GPU yet: the development machines have none. Its host side runs on CPU through the runner (staging,
graph buckets, the Triton kernel in Triton's interpreter); `bench/gpu/check.sh` is its test on a GPU.

On CUDA, launches are asynchronous, so the engine thread itself launches step N+1 while the device still runs
step N. Per step:

    h2d stream:      runner.prepare()'s host-to-device copies              --event--+
    compute stream:  (wait) placeholder gather -> forward -> sample -> token table update -> end event --+
    d2h stream:      (wait) sampled tokens -> this buffer slot's pinned host buffer -> done event

- Ordering is by events only; the host waits on one step's `done` event in `collect`, never on the device.
- Device-side placeholders: a device tensor holds each running request's latest sampled token (one row per
  request, assigned at its first sample, returned by `forget`). A decode scheduled with `PLACEHOLDER_TOKEN` gets its
  input id gathered from that table on the compute stream, so it never waits for a device-to-host copy.
- Readback goes into pinned buffers preallocated per buffer slot (no allocation, no pageable copy in the loop),
  sized with the token table for the largest max_num_seqs the KV pool allows, so live retuning never outgrows them.
- The step's inputs are staged by `ModelRunner.prepare` through pinned memory in one non-blocking copy, on the h2d
  stream, so they never wait for the running step.
- Busy time comes from CUDA events around forward + sample, placed on one clock by a reference event. Events bracket
  what was launched, not what ran: every KERNEL_SAMPLE_EVERY steps one step runs alone under torch's profiler, and the
  share of its event time that kernels ran goes to the busy tracker (`BusyTracker.record_kernel_share`), so a
  launch-bound step reads as the idle device it is.
- Decode-only steps replay a CUDA graph captured at start-up (`overlap.engine.model.graphs`): one launch per step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from overlap.engine.errors import ConfigError
from overlap.engine.execution.base import MAX_BUFFERS, Executor, StepResult, placeholder_source
from overlap.engine.execution.busy import BusyTracker, kernel_union_s
from overlap.engine.types import NONFINITE_TOKEN, ModelInput, ScheduledSeq

KERNEL_SAMPLE_EVERY = 1000  # steps between profiled steps
KERNEL_SAMPLE_FIRST = KERNEL_SAMPLE_EVERY - 1  # the first profiled step: short benchmark runs never pay for one
log = logging.getLogger(__name__)


@dataclass(slots=True)
class _CudaStep:
    step_id: int
    model_input: ModelInput
    slot: int | None = None
    num_sampled: int = 0
    logprobs: object = None  # the runner's device-side logprob tensors, for requests that asked
    inputs: object = None  # the step's inputs when they hold prompt logits to read back
    start: object = None  # torch.cuda.Event
    end: object = None
    done: object = None
    error: BaseException | None = None
    profiler: object = None  # torch.profiler.profile around this step while a sampled step runs


class CudaExecutor(Executor):
    """`Executor`'s interface for a `ModelRunner` on a CUDA device (needs its prepare / forward / sample)."""

    def __init__(self, runner, num_buffers: int = 2, busy: BusyTracker | None = None, max_seqs: int | None = None):
        import torch

        if getattr(getattr(runner, "device", None), "type", None) != "cuda" or not torch.cuda.is_available():
            raise ConfigError("CudaExecutor needs a model runner on a CUDA device")
        super().__init__(runner, num_buffers, busy)
        self._torch = torch
        device = runner.device
        self._device = device
        self._h2d = torch.cuda.Stream(device)
        self._compute = torch.cuda.Stream(device)
        self._d2h = torch.cuda.Stream(device)
        # Sized for the largest max_num_seqs the pool allows (Engine.reconfigure's bound), so live retuning never
        # outgrows the readback buffers or the token table.
        self._max_seqs = max_seqs or runner.num_kv_blocks
        num_rows = 4 * self._max_seqs + 64
        self._token_table = torch.zeros(num_rows, dtype=torch.long, device=device)
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._pinned = [torch.empty(self._max_seqs, dtype=torch.long, pin_memory=True) for _ in range(MAX_BUFFERS)]
        self._free_slots = deque(range(MAX_BUFFERS))
        # One clock for busy intervals: a reference event and the host time it completed at (one sync, at start).
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(self._compute)
        self._ref.synchronize()
        self._ref_host = time.perf_counter()

    # -- the pipeline --------------------------------------------------------------------------------------------
    def submit(self, model_input: ModelInput) -> int:
        assert not self.is_full, f"submit with {self.num_in_flight} of {self.num_buffers} buffers in flight"
        step = _CudaStep(self._next_step_id, model_input)
        self._next_step_id += 1
        profiled = step.step_id % KERNEL_SAMPLE_EVERY == KERNEL_SAMPLE_FIRST
        if profiled:
            self._start_profile(step)
        try:
            self._launch(step)
            if profiled:
                self._finish_profile(step)
        except Exception as exc:  # bad input or a launch failure: handed back with the step, in order
            if step.profiler is not None:
                step.profiler.__exit__(None, None, None)
                step.profiler = None
            step.error = exc
            self.forget(seq.request_id for seq in model_input.seqs)
            if step.slot is not None:
                self._free_slots.append(step.slot)
                step.slot = None
        self._in_flight.append(step)
        return step.step_id

    def _launch(self, step: _CudaStep) -> None:
        torch = self._torch
        runner = self.runner
        seqs = step.model_input.seqs
        # Host side: placeholder positions in the packed token matrix and token-table rows.
        gather_pos, gather_rows, sample_rows = [], [], []
        host_seqs = []
        offset = 0
        for seq in seqs:
            row = placeholder_source(seq, self._rows)  # the token-table row holding its latest token
            if row is not None:
                gather_pos.append(offset)
                gather_rows.append(row)
                seq = ScheduledSeq(
                    seq.request_id, [0], seq.start_pos, seq.block_table, seq.do_sample, seq.sampling, seq.num_generated
                )
            if seq.do_sample:
                sample_rows.append(self._row_for(seq.request_id))
            host_seqs.append(seq)
            offset += len(seq.token_ids)
        if len(sample_rows) > self._max_seqs:
            raise ValueError(f"{len(sample_rows)} sampled sequences exceed the readback buffer ({self._max_seqs})")
        step.slot = self._free_slots.popleft()
        step.num_sampled = len(sample_rows)

        with torch.cuda.stream(self._h2d):
            inputs = runner.prepare(ModelInput(host_seqs))
            gather_pos_t, gather_rows_t, sample_rows_t = runner.to_device(gather_pos, gather_rows, sample_rows)
            staged = torch.cuda.Event()
            staged.record(self._h2d)
        # Tensors made on the h2d stream and used on the compute stream: tell the caching allocator.
        for tensor in [*inputs.device_tensors(), gather_pos_t, gather_rows_t, sample_rows_t]:
            tensor.record_stream(self._compute)

        step.start = torch.cuda.Event(enable_timing=True)
        step.end = torch.cuda.Event(enable_timing=True)
        step.done = torch.cuda.Event()
        self._compute.wait_event(staged)
        with torch.cuda.stream(self._compute), torch.inference_mode():
            step.start.record(self._compute)
            if gather_pos:
                inputs.input_ids.index_copy_(0, gather_pos_t, self._token_table.index_select(0, gather_rows_t))
            logits = runner.forward(inputs)
            tokens, finite = runner.sample(logits, inputs)
            tokens = tokens.to(torch.long)
            runner.record_sampled(inputs, tokens)
            step.logprobs = runner.logprob_tensors(logits, inputs, tokens)  # None unless a request asks
            step.inputs = inputs if inputs.prompt_spans else None  # its prompt logits, read back after the step
            if sample_rows:
                self._token_table.index_copy_(0, sample_rows_t, tokens)
            # The token table keeps the sampled index (a later step may embed it); the host also learns which rows
            # had non-finite logits.
            readback = torch.where(finite, tokens, NONFINITE_TOKEN)
            step.end.record(self._compute)
        self._d2h.wait_event(step.end)
        with torch.cuda.stream(self._d2h):
            if sample_rows:
                self._pinned[step.slot][: len(sample_rows)].copy_(readback, non_blocking=True)
            readback.record_stream(self._d2h)
            step.done.record(self._d2h)

    def _start_profile(self, step: _CudaStep) -> None:
        """Profile this step alone: it starts once the steps in flight are done and ends before the next one is
        launched (a bubble of about one step per KERNEL_SAMPLE_EVERY)."""
        torch = self._torch
        for earlier in self._in_flight:
            if earlier.done is not None:
                earlier.done.synchronize()
        try:
            step.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            step.profiler.__enter__()
        except Exception as exc:  # no CUPTI, another profiler running: the event figures stand alone
            log.warning("kernel-time sampling is off: %s", exc)
            step.profiler = None

    def _finish_profile(self, step: _CudaStep) -> None:
        """The step's kernel time (the union of its kernels' intervals; copies are outside the event bracket) over
        its event-bracketed time."""
        profiler, step.profiler = step.profiler, None
        if profiler is None or step.done is None:
            return
        try:
            step.done.synchronize()
            profiler.__exit__(None, None, None)
            kernel_s = kernel_time_s(profiler)
            event_s = step.start.elapsed_time(step.end) / 1000
            if kernel_s > 0 and event_s > 0:
                self.busy.record_kernel_share(kernel_s / event_s)
        except Exception as exc:
            log.warning("kernel-time sampling failed: %s", exc)

    def _row_for(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError("device token table full: finished requests were not forgotten")
            row = self._rows[request_id] = self._free_rows.pop()
        return row

    def oldest_done(self) -> bool:
        if not self._in_flight:
            return False
        step = self._in_flight[0]
        return step.error is not None or step.done.query()

    def collect(self, block: bool = True) -> StepResult | None:
        if not self._in_flight or (not block and not self.oldest_done()):
            return None
        step = self._in_flight.popleft()
        if step.error is not None:
            self._forget_released()
            return StepResult(step.step_id, step.model_input, [], step.error)
        start = time.perf_counter()
        try:
            step.done.synchronize()  # this step's readback only, never the whole device
            tokens = self._pinned[step.slot][: step.num_sampled].tolist()
            logprobs = self.runner.logprob_lists(step.logprobs, step.num_sampled)  # after the step: no extra sync
            prompt_logprobs = None if step.inputs is None else self.runner.prompt_logprob_lists(step.inputs)
            begin_s = self._ref.elapsed_time(step.start) / 1000
            end_s = self._ref.elapsed_time(step.end) / 1000
        except Exception as exc:  # an asynchronous CUDA error surfaces here
            self.forget(seq.request_id for seq in step.model_input.seqs)
            return StepResult(step.step_id, step.model_input, [], exc)
        finally:
            self._free_slots.append(step.slot)
            self._forget_released()  # after the step's own token-table writes are done
        self.busy.record_interval(self._ref_host + begin_s, self._ref_host + end_s)
        self.busy.record_host("readback", time.perf_counter() - start)
        return StepResult(step.step_id, step.model_input, tokens, busy_s=end_s - begin_s, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)  # fmt: skip

    def _drop_device_token(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
        self._forget_in_runner(request_id)

    def close(self) -> list[StepResult]:
        return self.drain()


def kernel_time_s(profiler) -> float:
    """Seconds the GPU ran kernels in a finished torch profile: the union of their intervals (kernels of several
    streams counted once), copies and memsets left out."""
    import torch

    device = torch.autograd.DeviceType.CUDA
    intervals = [(e.time_range.start, e.time_range.end) for e in profiler.events()
                 if e.device_type == device and not e.name.startswith(("Memcpy", "Memset"))]  # fmt: skip
    return kernel_union_s(intervals) / 1e6
