"""The autoscalers users run today, as the replay's baselines: each reads the same signals as `decide()` every
tick and returns the replica count it would set. Their published algorithms, with their default windows divided by
the replay's time scale like the operator's:

- `hpa-cpu`: the Kubernetes HPA on CPU utilisation, target 70%. desired = ceil(ready x utilisation / target),
  nothing within a 10% tolerance, scale-up at once (at most double, or +4), scale-down to the highest
  recommendation of the last 300 s (its stabilisation window). A serving pod's CPU is busy while its device steps,
  so utilisation here is the device-busy share.
- `keda-queue`: a KEDA ScaledObject on `vllm:num_requests_waiting` with threshold 5 (an HPA external metric with
  an average-value target): desired = ceil(waiting / 5), the HPA's tolerance and stabilisation.
- `llmd-slo`: llm-d's SLO-aware law: s = the 45 s mean of min(max(P90 TTFT / TTFT SLO, P90 TPOT / TPOT SLO), 2),
  discounted by ready / provisioned replicas while pods warm up; one replica up above 0.55, one down below 0.40,
  hold in between.
"""

from __future__ import annotations

import math
from collections import deque

from overlap.operator.control.policy import Signals

HPA_TOLERANCE = 0.1
HPA_DOWN_STABILISATION_S = 300.0
HPA_CPU_TARGET = 0.7
KEDA_THRESHOLD = 5.0
LLMD_WINDOW_S = 45.0
LLMD_UP, LLMD_DOWN = 0.55, 0.40


class _Hpa:
    """The HPA's replica arithmetic around a metric ratio (current metric / target)."""

    def __init__(self, time_scale: float, low: int, high: int) -> None:
        self.stabilisation_s = HPA_DOWN_STABILISATION_S / time_scale
        self.low, self.high = low, high
        self.recommendations: deque[tuple[float, int]] = deque()

    def desired(self, now: float, ready: int, current: int, wanted: float | None) -> tuple[int, str]:
        if wanted is None or ready <= 0:
            return current, "no metric"
        ratio = wanted / max(ready, 1)
        raw = current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(wanted - 1e-9)
        raw = min(max(raw, self.low), self.high)
        self.recommendations.append((now, raw))
        while self.recommendations and now - self.recommendations[0][0] > self.stabilisation_s:
            self.recommendations.popleft()
        if raw > current:  # scale-up: at once, at most double or +4 pods per period
            return min(raw, max(2 * current, current + 4)), f"desired {raw} (metric ratio {ratio:.2f})"
        stable = max(r for _, r in self.recommendations)  # scale-down: the highest of the window
        return min(current, stable), f"desired {raw}, stabilised {stable}"


class HpaCpu:
    def __init__(self, time_scale: float, low: int, high: int) -> None:
        self.hpa = _Hpa(time_scale, low, high)

    def target(self, signals: Signals, current: int) -> tuple[int, str]:
        busy, ready = signals.device_busy, signals.ready_replicas
        wanted = None if busy is None else ready * busy / HPA_CPU_TARGET
        return self.hpa.desired(signals.time, ready, current, wanted)


class KedaQueue:
    def __init__(self, time_scale: float, low: int, high: int) -> None:
        self.hpa = _Hpa(time_scale, low, high)

    def target(self, signals: Signals, current: int) -> tuple[int, str]:
        waiting = signals.queue_depth
        wanted = None if waiting is None else waiting / KEDA_THRESHOLD
        return self.hpa.desired(signals.time, signals.ready_replicas, current, wanted)


class LlmdSlo:
    def __init__(self, time_scale: float, low: int, high: int, ttft_slo_s: float, tpot_slo_s: float) -> None:
        self.window_s = LLMD_WINDOW_S / time_scale
        self.low, self.high = low, high
        self.slos = (ttft_slo_s, tpot_slo_s)
        self.readings: deque[tuple[float, float]] = deque()

    def target(self, signals: Signals, current: int) -> tuple[int, str]:
        now = signals.time
        ratios = [v / slo for v, slo in zip((signals.ttft_p90_s, signals.itl_p90_s), self.slos, strict=True) if v]
        if ratios:
            self.readings.append((now, min(max(ratios), 2.0)))
        while self.readings and now - self.readings[0][0] > self.window_s:
            self.readings.popleft()
        if not self.readings:
            return current, "no latency reading"
        s = sum(r for _, r in self.readings) / len(self.readings)
        ask = s * signals.ready_replicas / max(current, 1)
        if ask > LLMD_UP and current < self.high:
            return current + 1, f"s {s:.2f}, ask {ask:.2f} > {LLMD_UP}"
        if ask < LLMD_DOWN and current > self.low:
            return current - 1, f"s {s:.2f}, ask {ask:.2f} < {LLMD_DOWN}"
        return current, f"s {s:.2f}: hold"


def make(name: str, time_scale: float, low: int, high: int, ttft_slo_s: float, tpot_slo_s: float):
    """The baseline controller of a run name."""
    if name == "hpa-cpu":
        return HpaCpu(time_scale, low, high)
    if name == "keda-queue":
        return KedaQueue(time_scale, low, high)
    if name == "llmd-slo":
        return LlmdSlo(time_scale, low, high, ttft_slo_s, tpot_slo_s)
    raise ValueError(f"no baseline {name!r}")
