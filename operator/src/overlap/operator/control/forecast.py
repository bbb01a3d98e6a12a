"""What the predictive floor learns from the service's own readings: where the arrival rate is going, how many
requests a replica serves, and how long a new replica takes to serve.

- `RateForecast`: Holt's linear trend on the arrival rate (level and slope, updated at irregular ticks) and, once a
  whole period (a day by default) has been seen, a profile of the rate by time of day, so a ramp seen yesterday is
  met before it comes back. It keeps the error of its own forecasts (what it said a horizon ago against what came).
- `CapacityProfile`: requests/s one replica finishes while it is saturated (requests waiting, device busy), per
  max_num_seqs value, since the batch limit sets what a replica can do.
- `ColdStart`: the time from a scale-up to its replicas being ready, as observed.
- `BurstMemory`: bursts of the rate (readings far above its median): how often they come and how high. Bursts
  shorter than a cold start cannot be chased: while they recur, the floor holds for a high quantile of their peaks.

All three are pure and kept in the control loop's History; the policy turns them into a replica floor.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

SATURATED_BUSY = 0.9  # device busy above this with requests waiting: what finishes is what a replica can do
SATURATED_BATCH = 0.9  # ... and the batches this full (running / max_num_seqs)
SATURATED_QUEUE = 8  # ... or this many waiting per replica


@dataclass(slots=True)
class RateForecast:
    alpha: float = 0.5  # level smoothing per tick (the rate signal is already a trailing-window mean)
    beta: float = 0.05  # slope smoothing per tick
    period_s: float = 86400.0
    buckets: int = 96  # profile resolution: 15 minutes of a day
    level: float | None = None
    slope: float = 0.0  # requests/s per second
    last_t: float | None = None
    first_t: float | None = None
    profile: list[float | None] = field(default_factory=list)
    # [due time, forecast, highest rate seen since] of forecasts made earlier, scored when their time comes
    pending: deque[list[float]] = field(default_factory=deque)
    relative_error: float | None = None  # smoothed |forecast - actual| / actual

    def update(self, t: float, rate: float, horizon_s: float) -> None:
        """One reading of the arrival rate (requests/s) at time t; remembers the forecast for t + horizon_s."""
        # A forecast says the highest rate of its horizon: score it against the highest that came.
        for entry in self.pending:
            entry[2] = max(entry[2], rate)
        while self.pending and self.pending[0][0] <= t:
            _, said, came = self.pending.popleft()
            if came > 0:
                error = abs(said - came) / came
                self.relative_error = error if self.relative_error is None else 0.8 * self.relative_error + 0.2 * error
        if self.level is None:
            self.first_t = t
            self.profile = [None] * self.buckets
        self.level, self.slope = self._advanced(t, rate)
        self.last_t = t
        i = self._bucket(t)
        old = self.profile[i]
        self.profile[i] = rate if old is None else 0.7 * old + 0.3 * rate
        self.pending.append([t + horizon_s, self.predict(t, horizon_s), 0.0])

    def _advanced(self, t: float, rate: float) -> tuple[float, float]:
        """(level, slope) after a reading of `rate` at t."""
        if self.level is None or self.last_t is None:
            return rate, 0.0
        dt = max(t - self.last_t, 1e-9)
        predicted = self.level + self.slope * dt
        level = self.alpha * rate + (1 - self.alpha) * predicted
        slope = self.beta * (level - self.level) / dt + (1 - self.beta) * self.slope
        return max(level, 0.0), slope

    def predict_with(self, t: float, rate: float, horizon_s: float) -> float:
        """predict() as it would be after a reading of `rate` at t, without keeping the reading."""
        return self._predict(t, horizon_s, *self._advanced(t, rate))

    def has_profile(self, t: float) -> bool:
        """True once a whole period of readings has been seen."""
        return self.first_t is not None and t - self.first_t >= self.period_s

    def predict(self, t: float, horizon_s: float) -> float:
        """The highest rate expected between t and t + horizon_s (requests/s): the trend's, or where a period has
        been seen, the profile's for that stretch scaled to how today compares with it, whichever is higher."""
        if self.level is None:
            return 0.0
        return self._predict(t, horizon_s, self.level, self.slope)

    def _predict(self, t: float, horizon_s: float, level: float, slope: float) -> float:
        trend = max(level, level + slope * horizon_s)
        if not self.has_profile(t):
            return trend
        now = self.profile[self._bucket(t)]
        ahead = [self.profile[self._bucket(t + s)] for s in _steps(horizon_s, self.period_s / self.buckets)]
        ahead = [v for v in ahead if v is not None]
        if not now or not ahead:
            return trend
        ratio = min(max(level / now, 0.5), 1.5)
        return max(trend, max(ahead) * ratio)

    def _bucket(self, t: float) -> int:
        return int((t % self.period_s) / self.period_s * self.buckets) % self.buckets


def quantile(values, q: float) -> float:
    """The nearest-rank q-quantile of a non-empty collection (an observed value, never an interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _steps(horizon_s: float, bucket_s: float) -> list[float]:
    n = max(1, math.ceil(horizon_s / bucket_s))
    return [horizon_s * k / n for k in range(n + 1)]


BURST_RATIO = 2.0  # a reading this many times the base rate (the median of the readings between runs) is in a run
# Bursts recur while the last began within this many of their mean gaps: gaps between random bursts are about
# exponential, and one over twice the mean comes in one of seven, one over three in one of twenty.
BURST_HOLD_GAPS = 3.0
BURST_PEAK_QUANTILE = 0.75  # the peak held for: this quantile of the bursts' peak readings


@dataclass(slots=True)
class BurstMemory:
    """The arrival rate's bursts over the last `keep_s`: when each began and its peak reading. A burst is a run of
    readings over BURST_RATIO x the base rate that ends within `max_len_s` (the caller's: what a cold start cannot
    chase); a longer run is a change of level (a daily peak), which the trend and the reactive rules follow.

    While bursts recur (two seen, and the last began within BURST_HOLD_GAPS of their mean gap) the memory holds a
    peak for the floor: a high quantile of their peaks, which does not fall until they stop (a few small bursts
    would pull the quantile under the large ones the fleet was sized for)."""

    keep_s: float = 3600.0
    readings: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (time, rate, in a run of high ones)
    bursts: deque[tuple[float, float]] = field(default_factory=deque)  # (start, peak rate) of the bursts seen
    last_end: float | None = None  # when the last burst ended (its first reading back under the threshold)
    _run: list[float] | None = None  # [start, peak, threshold] of the run of high readings going on
    _sustained: bool = False  # that run outlasted max_len_s: not a burst
    _held: float | None = None  # the peak held for since bursts began to recur

    def update(self, t: float, rate: float, max_len_s: float) -> None:
        # a run is measured against the base from before it began: a ramp that lifts the median stays one run
        threshold = self._run[2] if self._run is not None else BURST_RATIO * self.base()
        high = threshold > 0 and rate > threshold
        self.readings.append((t, rate, high))
        while self.readings and t - self.readings[0][0] > self.keep_s:
            self.readings.popleft()
        while self.bursts and t - self.bursts[0][0] > self.keep_s:
            self.bursts.popleft()
        if high:
            if self._run is None:
                self._run = [t, rate, threshold]
            self._run[1] = max(self._run[1], rate)
            self._sustained = self._sustained or t - self._run[0] > max_len_s
        else:
            if self._run is not None and not self._sustained:
                self.bursts.append((self._run[0], self._run[1]))
                self.last_end = t
            self._run, self._sustained = None, False
        if not self._recurring(t):
            self._held = None
        elif self.bursts:
            peak = quantile([peak for _, peak in self.bursts], BURST_PEAK_QUANTILE)
            self._held = max(self._held or 0.0, peak)

    def base(self) -> float:
        """The rate between runs of high readings: their median. A run's own readings are left out: a trace that
        opens with a long run would otherwise lift the base over the bursts that follow it."""
        rates = [rate for _, rate, high in self.readings if not high]
        return quantile(rates, 0.5) if rates else 0.0

    def since_burst_s(self, t: float, rate: float) -> float:
        """Seconds since the last burst ended, with `rate` the reading at t (not yet kept): one that ends the run going
        on ends it now. Infinite before any burst."""
        if self._run is not None and not self._sustained and rate <= self._run[2]:
            return 0.0
        return math.inf if self.last_end is None else t - self.last_end

    def mean_gap_s(self) -> float | None:
        """Seconds between burst starts, on average; None before two bursts."""
        if len(self.bursts) < 2:
            return None
        return (self.bursts[-1][0] - self.bursts[0][0]) / (len(self.bursts) - 1)

    def _recurring(self, t: float) -> bool:
        """Two bursts seen and the last began within BURST_HOLD_GAPS of their mean gap. A run of high readings going
        on counts as the last: the burst that ends a long gap is held for, not chased."""
        gap = self.mean_gap_s()
        if gap is None:
            return False
        last = self._run[0] if self._run is not None and not self._sustained else self.bursts[-1][0]
        return t - last <= BURST_HOLD_GAPS * gap

    def recurring_peak(self, t: float) -> float | None:
        """The rate to hold capacity for while bursts recur; None when they do not."""
        return self._held if self._held is not None and self._recurring(t) else None


@dataclass(slots=True)
class CapacityProfile:
    """Requests/s one saturated replica finishes, per max_num_seqs: the 90th percentile of the last saturated
    readings at that limit. A saturated replica never finishes much more than it can, while a reading over a rate
    window that began before the saturation, or just after a replica started, is low: a high percentile of recent
    readings is the figure, and old ones age out when the workload changes."""

    samples: dict[int, deque[float]] = field(default_factory=dict)
    # The finish rate is a rate over this window: a reading counts once the replicas were saturated for all of it
    # (a burst shorter than the window saturates them for part of it, and the rate says less than they can do).
    window_s: float = 0.0
    keep: int = 32  # readings kept per limit
    min_readings: int = 8  # a figure is used once this many readings stand behind it (the first are often low)
    # figures measured offline per max_num_seqs (autoscaling.predictive.capacityPerReplica/capacityProfile), until
    # the loop has its own at that limit
    hints: Mapping[int, float] = field(default_factory=dict)

    _saturated_since: float | None = None

    def update(
        self,
        t: float,
        max_num_seqs: int,
        finish_rate: float,
        replicas: int,
        waiting: float,
        running: float,
        busy: float,
    ) -> None:
        # Requests waiting while the device is busy and either the batches are full or the queue is long (the
        # step's token budget or the KV cache holds them back): what finishes is what a replica can do at these
        # limits. A few waiting between two steps is not saturation.
        full = running >= SATURATED_BATCH * max_num_seqs * replicas
        long_queue = waiting >= SATURATED_QUEUE * replicas
        saturated = replicas > 0 and waiting >= replicas and busy >= SATURATED_BUSY and (full or long_queue)
        if not saturated:
            self._saturated_since = None
            return  # not saturated: what finishes says what was asked, not what a replica can do
        if self._saturated_since is None:
            self._saturated_since = t
        if finish_rate <= 0 or t - self._saturated_since < self.window_s:
            return
        self.samples.setdefault(max_num_seqs, deque(maxlen=self.keep)).append(finish_rate / replicas)

    def get(self, max_num_seqs: int) -> float | None:
        """The capacity at this limit: measured once enough saturated readings stand behind it, before that the
        offline figure for this limit, else None. A figure from another limit is not used: a lower limit's would
        keep the fleet too large to ever saturate at this one, so it would never be corrected."""
        return self._measured(max_num_seqs) or self.hints.get(max_num_seqs)

    def _measured(self, max_num_seqs: int) -> float | None:
        readings = self.samples.get(max_num_seqs, ())
        return quantile(readings, 0.9) if len(readings) >= self.min_readings else None

    def gain(self, old: int, new: int) -> float | None:
        """How much more a replica finishes at limit `new` than at `old` (0.1: a tenth more), from figures of one
        kind (both measured, else both offline: a measured figure and an offline one differ by more than the limit
        does); None when neither kind has both."""
        for figure in (self._measured, self.hints.get):
            before, after = figure(old), figure(new)
            if before and after:
                return after / before - 1
        return None


@dataclass(slots=True)
class ColdStart:
    """Seconds from a scale-up to its replicas being ready (EWMA of the starts seen; `default` before any)."""

    default: float = 60.0
    observed: float | None = None
    _since: float | None = None

    def scaled_up(self, t: float) -> None:
        if self._since is None:
            self._since = t

    def track(self, t: float, asked: int, ready: int) -> bool:
        """A reading after the decision: `asked` replicas wanted, `ready` of them serving. True when this reading
        finds the replicas of a scale-up all ready."""
        if asked > ready or self._since is None:
            return False
        took = t - self._since
        self.observed = took if self.observed is None else 0.7 * self.observed + 0.3 * took
        self._since = None
        return True

    def seconds(self) -> float:
        return self.default if self.observed is None else self.observed
