"""Device-busy accounting, measured where the work happens.

Each step's busy interval comes from the place that ran it: CUDA events on a GPU (converted to seconds on one
clock), the forward's own start and end on CPU, the simulated device's exact sleep. Never a sampled "is anything
running" flag. From the intervals: the busy ratio over a sliding window, the distribution of idle gaps between
consecutive steps, and the host-side time per step spent scheduling, staging and reading back.

Events bracket what the host launched, so a step whose kernels wait on Python launches reads as busy while the GPU
idles between kernels. The CUDA executor therefore profiles one step now and then and records the share of its
event-bracketed time that kernels actually ran (`record_kernel_share`); the busy figures come in both forms.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from statistics import median


@dataclass(slots=True)
class BusyStats:
    busy_ratio: float  # busy time / elapsed time over the window (0 when nothing ran)
    window_s: float  # the elapsed time the ratio covers (<= the configured window)
    num_steps: int  # steps in the window
    busy_s: float
    idle_gap_ms: dict[str, float]  # mean, p50, p90, p99, max of the gaps between consecutive steps in the window
    host_ms_per_step: dict[str, float] = field(default_factory=dict)  # phase -> mean ms over recent steps
    # The share of event-bracketed step time that kernels ran (profiled steps; None: never profiled), and the busy
    # ratio by kernel time (busy_ratio x that share).
    kernel_share: float | None = None
    kernel_busy_ratio: float | None = None

    def to_dict(self) -> dict:
        return {
            "kernel_share": self.kernel_share,
            "kernel_busy_ratio": self.kernel_busy_ratio,
            "busy_ratio": self.busy_ratio,
            "window_s": self.window_s,
            "num_steps": self.num_steps,
            "busy_s": self.busy_s,
            "idle_gap_ms": dict(self.idle_gap_ms),
            "host_ms_per_step": dict(self.host_ms_per_step),
        }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


class BusyTracker:
    """Collects device busy intervals (any one clock, in seconds) and host-side phase times. Thread-safe: the
    executor's worker records intervals while the engine thread records host phases and reads stats."""

    def __init__(self, window_s: float = 10.0, max_steps: int = 8192, max_host_samples: int = 1024) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        # (start, end, idle gap before this step or None when the engine had no work before it)
        self._steps: deque[tuple[float, float, float | None]] = deque(maxlen=max_steps)
        self._host: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=max_host_samples))
        self._last_end: float | None = None
        self._paused = True
        self.num_steps_total = 0
        self.busy_s_total = 0.0
        self._kernel_shares: deque[float] = deque(maxlen=8)

    def record_interval(self, start: float, end: float) -> None:
        """One step ran on the device from `start` to `end`."""
        with self._lock:
            gap = None
            if not self._paused and self._last_end is not None:
                gap = max(0.0, start - self._last_end)
            self._steps.append((start, end, gap))
            self._last_end = end if self._last_end is None else max(self._last_end, end)
            self._paused = False
            self.num_steps_total += 1
            self.busy_s_total += end - start

    def record_kernel_share(self, share: float) -> None:
        """A profiled step: kernel time (the union of its kernels' intervals) / its event-bracketed time."""
        with self._lock:
            self._kernel_shares.append(min(1.0, max(0.0, share)))

    @property
    def kernel_share(self) -> float | None:
        """The median of the recent profiled steps' kernel shares; None before any."""
        with self._lock:
            return median(self._kernel_shares) if self._kernel_shares else None

    def pause(self) -> None:
        """The engine ran out of work: the gap before the next step is not an overhead gap."""
        with self._lock:
            self._paused = True

    def record_host(self, phase: str, seconds: float) -> None:
        """Host time of one step's phase: schedule, stage, readback, postprocess, ..."""
        with self._lock:
            self._host[phase].append(seconds)

    def snapshot(self, now: float | None = None) -> BusyStats:
        """Stats over the last `window_s` ending at `now` (default: the last step's end), on the intervals' clock."""
        with self._lock:
            steps = list(self._steps)
            host = {phase: list(values) for phase, values in self._host.items()}
        host_ms = {phase: 1000 * sum(v) / len(v) for phase, v in host.items() if v}
        share = self.kernel_share
        if not steps:
            return BusyStats(0.0, 0.0, 0, 0.0, _gap_summary([]), host_ms, share, None if share is None else 0.0)
        end = max(e for _, e, _ in steps) if now is None else now
        begin = max(end - self.window_s, min(s for s, _, _ in steps))
        busy = 0.0
        gaps = []
        num = 0
        for start, stop, gap in steps:
            overlap = min(stop, end) - max(start, begin)
            if overlap > 0:
                busy += overlap
                num += 1
                if gap is not None and start >= begin:
                    gaps.append(gap)
        elapsed = end - begin
        ratio = min(1.0, busy / elapsed) if elapsed > 0 else 0.0
        kernel_ratio = None if share is None else ratio * share
        return BusyStats(ratio, elapsed, num, busy, _gap_summary(gaps), host_ms, share, kernel_ratio)


def kernel_union_s(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by (start, end) intervals, overlaps counted once (kernels of several streams)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _gap_summary(gaps: list[float]) -> dict[str, float]:
    values = sorted(g * 1000 for g in gaps)
    return {
        "mean": sum(values) / len(values) if values else 0.0,
        "p50": _percentile(values, 0.50),
        "p90": _percentile(values, 0.90),
        "p99": _percentile(values, 0.99),
        "max": values[-1] if values else 0.0,
        "count": float(len(values)),
    }
