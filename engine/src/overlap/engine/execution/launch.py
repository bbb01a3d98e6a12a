"""The executor for runners that launch asynchronously (`launch` / `wait`), as the simulated device does."""

from __future__ import annotations

import time

from overlap.engine.execution.base import Executor, Step
from overlap.engine.types import ModelInput


class AsyncExecutor(Executor):
    """The pipeline for a runner with `step_mode = "launch"`: `launch(ModelInput) -> handle` (with the `start` and
    `end` of its device time) and `wait(handle) -> RunnerOutput`, as the simulated device offers. The engine thread
    launches each step, the device runs them back to back, `collect` waits for the oldest. Placeholders are filled on
    the device side by the runner. The same structure as the CUDA path, without CUDA."""

    def submit(self, model_input: ModelInput) -> int:
        assert not self.is_full, f"submit with {self.num_in_flight} of {self._num_buffers} buffers in flight"
        step = Step(self._next_step_id, model_input)
        self._next_step_id += 1
        try:
            step.pending = self.runner.launch(model_input)
        except Exception as exc:
            step.error = exc
        self._in_flight.append(step)
        return step.step_id

    def oldest_done(self) -> bool:
        return bool(self._in_flight) and (
            self._in_flight[0].error is not None or self._in_flight[0].pending.end <= time.perf_counter()
        )

    def collect(self, block: bool = True) -> Step | None:
        if not self._in_flight or (not block and not self.oldest_done()):
            return None
        step = self._in_flight.popleft()
        try:
            if step.error is not None:
                return step.done(error=step.error)
            try:
                output = self.runner.wait(step.pending)  # the device-side work (placeholders) happens here
            except Exception as exc:
                return step.done(error=exc)
        finally:
            self._forget_released()  # only now has this step used its requests' device-side tokens
        self.busy.record_interval(*output.busy)
        return step.done(output)

    def _drop_device_token(self, request_id: str) -> None:
        self.runner.forget_request(request_id)
