"""The simulated fleet: one `Replica` per pod (a real Engine on the simulated device, on its own thread), and the
router's rule for picking one."""

from __future__ import annotations

import threading
import time

from overlap.bench.control_replay.plan import Setup
from overlap.engine.config import LiveKnobs


class Pod:
    """What the loop reads of a pod, whichever fleet it is in: when it was asked for and will be ready, whether it is
    draining or gone, its outstanding requests, and the replica-seconds it cost."""

    def __init__(self, created: float, ready_at: float) -> None:
        self.created = created
        self.ready_at = ready_at
        self.stopped: float | None = None  # when it went (drained, or cancelled while starting)
        self.draining = False
        self.num_submitted = 0  # written by the router only
        self.num_finished = 0  # written by the pod's stepping only

    def is_ready(self, now: float) -> bool:
        return not self.draining and self.stopped is None and now >= self.ready_at

    @property
    def is_asked_for(self) -> bool:
        """Counted in the replica count the controller sees (ready or starting, not draining)."""
        return not self.draining and self.stopped is None

    @property
    def outstanding(self) -> int:
        return self.num_submitted - self.num_finished

    def lifetime(self, end: float) -> float:
        """Replica-seconds it cost up to `end`: from the scale-up (a starting pod already holds its node) until it
        went."""
        stopped = end if self.stopped is None else min(self.stopped, end)
        return max(0.0, stopped - self.created)


class Replica(Pod):
    """One simulated pod: an Engine on an asynchronous SimRunner, stepped by its own thread. Times are seconds on
    the run's clock (`clock()`)."""

    def __init__(self, name: str, setup: Setup, knobs: LiveKnobs, clock, ready_at: float, on_finished) -> None:
        from overlap.engine import Engine, EngineConfig
        from overlap.engine.model.sim_runner import CostModel, SimRunner

        fixed_ms, per_token_us = setup.cost_ms_us
        config = EngineConfig().with_live(knobs)
        runner = SimRunner.from_config(config, CostModel(fixed_ms / 1000, per_token_us / 1e6), asynchronous=True)
        self.name = name
        self.engine = Engine(config, runner=runner)
        super().__init__(clock(), ready_at)
        self._clock = clock
        self._busy_s_seen = 0.0
        self._on_finished = on_finished
        self._closing = False
        self._wakeup = threading.Event()
        self._thread = threading.Thread(target=self._drive, name=f"replica-{name}", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, tokens: list[int], sampling, arrival_time: float) -> None:
        from overlap.engine import RequestSpec

        self.engine.add_request(RequestSpec(request_id, tokens, sampling, arrival_time=arrival_time))
        self.num_submitted += 1
        self._wakeup.set()

    def busy_since_last(self) -> float:
        """Device-busy seconds since the previous call (what rate() over a busy-seconds counter gives)."""
        total = self.engine.runner.busy_s_total
        delta, self._busy_s_seen = total - self._busy_s_seen, total
        return delta

    def drain(self, now: float) -> None:
        """Stop receiving; the thread finishes what it holds, then the replica goes. One still starting holds
        nothing and goes now."""
        self.draining = True
        if now < self.ready_at:
            self.stopped = now
        self._wakeup.set()

    def _drive(self) -> None:
        engine = self.engine
        while not self._closing:
            if not engine.has_unfinished() and not engine.executor.num_in_flight:
                if self.draining:
                    break
                self._wakeup.wait(0.02)
                self._wakeup.clear()
                continue
            outputs = engine.step()
            for out in outputs:
                if out.finished:
                    self.num_finished += 1
                    self._on_finished(out)
            if not outputs and not engine.scheduler.running:
                time.sleep(0.0005)  # requests wait for KV blocks: do not spin
        if self.stopped is None and self.draining:
            self.stopped = self._clock()

    def close(self) -> None:
        self._closing = True
        self._wakeup.set()
        self._thread.join(timeout=5)
        self.engine.close()


def least_loaded(fleet: list[Pod], now: float) -> Pod | None:
    """The router's rule: the ready replica with the fewest outstanding requests (join-shortest-queue); None when
    none is ready."""
    ready = [r for r in fleet if r.is_ready(now)]
    return min(ready, key=lambda r: r.outstanding) if ready else None
