"""The execution layer's CUDA path: the same N-buffered pipeline as `Executor`, with no worker thread.

Run on a GPU once (an H200: the README's GPU table); the development machines have none, so its host side also runs
on CPU through the runner (staging, graph buckets, the Triton kernel in Triton's interpreter); `bench/gpu/check.sh`
is its test on a GPU.

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

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

from overlap.engine.errors import ConfigError
from overlap.engine.execution.base import MAX_BUFFERS, Executor, Step, placeholder_source
from overlap.engine.execution.busy import BusyTracker, kernel_union_s
from overlap.engine.types import ModelInput, RunnerOutput

KERNEL_SAMPLE_EVERY = 1000  # steps between profiled steps
KERNEL_SAMPLE_FIRST = KERNEL_SAMPLE_EVERY - 1  # the first profiled step: short benchmark runs never pay for one
log = logging.getLogger(__name__)


@dataclass(slots=True)
class _OnDevice:
    """An in-flight step's CUDA side (`Step.pending`)."""

    slot: int | None = None  # its pinned readback buffer
    num_sampled: int = 0
    device_step: object = None  # the runner's DeviceStep: tokens, logprob tensors, inputs
    start: object = None  # torch.cuda.Event
    end: object = None
    done: object = None
    profiler: object = None  # torch.profiler.profile around this step while a sampled step runs


class CudaExecutor(Executor):
    """`Executor`'s interface for a `ModelRunner` on a CUDA device (its prepare / device_step / read_back)."""

    def __init__(self, runner, num_buffers: int = 2, busy: BusyTracker | None = None, max_seqs: int | None = None):
        import torch

        if runner.step_mode != "cuda" or not torch.cuda.is_available():
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
        step = Step(self._next_step_id, model_input, _OnDevice())
        self._next_step_id += 1
        profiled = step.step_id % KERNEL_SAMPLE_EVERY == KERNEL_SAMPLE_FIRST
        if profiled:
            self._start_profile(step)
        try:
            self._launch(step)
            if profiled:
                self._finish_profile(step)
        except Exception as exc:  # bad input or a launch failure: handed back with the step, in order
            work = step.pending
            if work.profiler is not None:
                work.profiler.__exit__(None, None, None)
                work.profiler = None
            step.error = exc
            self.forget(seq.request_id for seq in model_input.seqs)
            if work.slot is not None:
                self._free_slots.append(work.slot)
                work.slot = None
        self._in_flight.append(step)
        return step.step_id

    def _launch(self, step: Step) -> None:
        torch = self._torch
        runner, work = self.runner, step.pending
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
                seq = dataclasses.replace(seq, token_ids=[0], prompt_token_ids=None, num_draft_tokens=0)
            if seq.do_sample:
                sample_rows.append(self._row_for(seq.request_id))
            host_seqs.append(seq)
            offset += len(seq.token_ids)
        if len(sample_rows) > self._max_seqs:
            raise ValueError(f"{len(sample_rows)} sampled sequences exceed the readback buffer ({self._max_seqs})")
        work.slot = self._free_slots.popleft()
        work.num_sampled = len(sample_rows)

        with torch.cuda.stream(self._h2d):
            inputs = runner.prepare(ModelInput(host_seqs, step.model_input.lora_loads))
            gather_pos_t, gather_rows_t, sample_rows_t = runner.to_device(gather_pos, gather_rows, sample_rows)
            staged = torch.cuda.Event()
            staged.record(self._h2d)
        # Tensors made on the h2d stream and used on the compute stream: tell the caching allocator.
        for tensor in [*inputs.device_tensors(), gather_pos_t, gather_rows_t, sample_rows_t]:
            tensor.record_stream(self._compute)

        work.start = torch.cuda.Event(enable_timing=True)
        work.end = torch.cuda.Event(enable_timing=True)
        work.done = torch.cuda.Event()
        self._compute.wait_event(staged)
        with torch.cuda.stream(self._compute), torch.inference_mode():
            work.start.record(self._compute)
            if gather_pos:
                inputs.input_ids.index_copy_(0, gather_pos_t, self._token_table.index_select(0, gather_rows_t))
            work.device_step = runner.device_step(inputs)
            if sample_rows:
                # The token table keeps the sampled index (a later step may embed it); the host reads back the
                # tokens with the rows whose logits were not finite marked.
                self._token_table.index_copy_(0, sample_rows_t, work.device_step.tokens)
            work.end.record(self._compute)
        readback = work.device_step.readback
        self._d2h.wait_event(work.end)
        with torch.cuda.stream(self._d2h):
            if sample_rows:
                self._pinned[work.slot][: len(sample_rows)].copy_(readback, non_blocking=True)
            readback.record_stream(self._d2h)
            work.done.record(self._d2h)

    def _start_profile(self, step: Step) -> None:
        """Profile this step alone: it starts once the steps in flight are done and ends before the next one is
        launched (a bubble of about one step per KERNEL_SAMPLE_EVERY)."""
        torch = self._torch
        for earlier in self._in_flight:
            if earlier.pending.done is not None:
                earlier.pending.done.synchronize()
        work = step.pending
        try:
            work.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            work.profiler.__enter__()
        except Exception as exc:  # no CUPTI, another profiler running: the event figures stand alone
            log.warning("kernel-time sampling is off: %s", exc)
            work.profiler = None

    def _finish_profile(self, step: Step) -> None:
        """The step's kernel time (the union of its kernels' intervals; copies are outside the event bracket) over
        its event-bracketed time."""
        work = step.pending
        profiler, work.profiler = work.profiler, None
        if profiler is None or work.done is None:
            return
        try:
            work.done.synchronize()
            profiler.__exit__(None, None, None)
            kernel_s = kernel_time_s(profiler)
            event_s = work.start.elapsed_time(work.end) / 1000
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
        return step.error is not None or step.pending.done.query()

    def collect(self, block: bool = True) -> Step | None:
        if not self._in_flight or (not block and not self.oldest_done()):
            return None
        step = self._in_flight.popleft()
        if step.error is not None:
            self._forget_released()
            return step.done(error=step.error)
        work = step.pending
        start = time.perf_counter()
        try:
            work.done.synchronize()  # this step's readback only, never the whole device
            tokens = self._pinned[work.slot][: work.num_sampled].tolist()
            # after the step: no extra sync; speculative steps' accepted tokens come back here too
            logprobs, prompt_logprobs, spec_tokens, spec_logprobs = self.runner.read_back(work.device_step)
            begin_s = self._ref.elapsed_time(work.start) / 1000
            end_s = self._ref.elapsed_time(work.end) / 1000
        except Exception as exc:  # an asynchronous CUDA error surfaces here
            self.forget(seq.request_id for seq in step.model_input.seqs)
            return step.done(error=exc)
        finally:
            self._free_slots.append(work.slot)
            self._forget_released()  # after the step's own token-table writes are done
        busy = (self._ref_host + begin_s, self._ref_host + end_s)
        self.busy.record_interval(*busy)
        self.busy.record_host("readback", time.perf_counter() - start)
        return step.done(RunnerOutput(tokens, busy, logprobs, prompt_logprobs, spec_tokens, spec_logprobs))

    def _drop_device_token(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
        self.runner.forget_request(request_id)

    def close(self) -> list[Step]:
        return self.drain()


def kernel_time_s(profiler) -> float:
    """Seconds the GPU ran kernels in a finished torch profile: the union of their intervals (kernels of several
    streams counted once), copies and memsets left out."""
    import torch

    device = torch.autograd.DeviceType.CUDA
    intervals = [(e.time_range.start, e.time_range.end) for e in profiler.events()
                 if e.device_type == device and not e.name.startswith(("Memcpy", "Memset"))]  # fmt: skip
    return kernel_union_s(intervals) / 1e6
