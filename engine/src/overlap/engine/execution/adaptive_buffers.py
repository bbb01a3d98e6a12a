"""Adaptive buffers: pick `num_buffers` from measured host time per step versus device time per step.

The rule, from the pipeline arithmetic (overlap.bench.overlap_load `predicted_idle_share`):
- host time is a negligible share of device time (< `negligible`): 1 buffer. Overlap could win back at most that
  share, and a second buffer costs a step of work after each EOS and a worker thread.
- some steps' host time exceeds the device step (the host's p90 above the device mean) while the mean does not:
  3 buffers, so the host can run up to two steps ahead and absorb its slow steps.
- otherwise 2. With the mean host time above the device time the host sets the pace and more buffers do not help.

`decide` is a pure function; `BufferAdvisor` applies it every `every_steps` steps with hysteresis (a change must be
proposed twice in a row) and keeps the last decisions with their reasons for stats.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class BufferDecision:
    at: float  # time.monotonic()
    old: int
    new: int
    reason: str

    def to_dict(self) -> dict:
        return {"at": self.at, "from": self.old, "to": self.new, "reason": self.reason}


def decide(host_s: list[float], device_s: list[float], negligible: float = 0.02) -> tuple[int, str]:
    """(num_buffers, reason) for per-step host times and device times (seconds, recent steps)."""
    if not host_s or not device_s:
        return 2, "no measurements yet: double buffering"
    host_mean = sum(host_s) / len(host_s)
    device_mean = sum(device_s) / len(device_s)
    host_p90 = sorted(host_s)[int(0.9 * (len(host_s) - 1))]
    figures = f"host {1000 * host_mean:.2f} ms (p90 {1000 * host_p90:.2f}) vs device {1000 * device_mean:.2f} ms"
    if device_mean <= 0:
        return 2, f"{figures}: no device time measured, double buffering"
    if host_mean < negligible * device_mean:
        return 1, f"{figures}: host time under {100 * negligible:.0f}% of the device step, nothing to overlap"
    if host_mean >= device_mean:
        return 2, f"{figures}: the host sets the pace; more than 2 buffers cannot help"
    if host_p90 > device_mean:
        return 3, f"{figures}: slow host steps exceed the device step; a third buffer absorbs them"
    return 2, f"{figures}: host fits under the device step; double buffering hides it"


class BufferAdvisor:
    def __init__(self, every_steps: int = 64, window: int = 256, max_decisions: int = 16) -> None:
        self.every_steps = every_steps
        self._host: deque[float] = deque(maxlen=window)
        self._device: deque[float] = deque(maxlen=window)
        self._steps = 0
        self._proposal: int | None = None
        self.decisions: deque[BufferDecision] = deque(maxlen=max_decisions)

    def record(self, host_s: float, device_s: float) -> None:
        self._host.append(host_s)
        self._device.append(device_s)
        self._steps += 1

    def advise(self, current: int) -> int | None:
        """A new buffer count to apply now, or None (not due, no change, or not yet confirmed)."""
        if self._steps < self.every_steps:
            return None
        self._steps = 0
        wanted, reason = decide(list(self._host), list(self._device))
        if wanted == current:
            self._proposal = None
            return None
        if self._proposal != wanted:  # hysteresis: the same change twice in a row
            self._proposal = wanted
            return None
        self._proposal = None
        self.decisions.append(BufferDecision(time.monotonic(), current, wanted, reason))
        return wanted
