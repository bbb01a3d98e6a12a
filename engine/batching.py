"""Batching policies: how many waiting requests the scheduler may admit at a step boundary.

Field report 2 compared four policies on the same model and runner; the engine replays that experiment by
swapping this one object. `continuous` admits whenever there is room (the scheduler's token budget, sequence cap
and KV pool still apply). The other three batch whole requests and let the batch run until every member has
finished before the next batch starts, as static batching does, so head-of-line blocking shows up as it does in
practice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from overlap.engine.errors import ConfigError


@dataclass(slots=True)
class Continuous:
    def num_to_admit(self, now: float, num_waiting: int, oldest_arrival: float | None, num_running: int) -> int:
        return num_waiting


@dataclass(slots=True)
class Serial:
    """One request at a time."""

    def num_to_admit(self, now: float, num_waiting: int, oldest_arrival: float | None, num_running: int) -> int:
        return 1 if num_running == 0 and num_waiting else 0


@dataclass(slots=True)
class FixedWindow:
    """Time-window batching: the clock is cut into fixed windows of `window_ms`; the requests that come in during
    one window form one batch, dispatched once the window has closed and the device is free. Batches queue up in
    window order while the device is busy, so the batch size follows the arrival rate (rate x window), not the
    backlog: under load this is the conservative policy field report 2 measured.

    The scheduler tells a policy only how many requests wait, so arrivals are counted as the growth of the queue
    between calls (the scheduler consults the policy at every step that has room, and requests enter the engine at
    step boundaries anyway); a request the scheduler could not admit with its batch joins the current window."""

    window_ms: float = 50.0
    _origin: float | None = None  # start of window 0
    _num_assigned: int = 0  # waiting requests already counted into a window
    _windows: deque = field(default_factory=deque)  # [window end, count] of closed-or-open windows, oldest first

    def num_to_admit(self, now: float, num_waiting: int, oldest_arrival: float | None, num_running: int) -> int:
        window_s = self.window_ms / 1000
        if self._origin is None:
            if not num_waiting:
                return 0
            self._origin = oldest_arrival if oldest_arrival is not None else now
        gone = self._num_assigned - num_waiting  # aborted or timed out: take them off the oldest windows
        while gone > 0 and self._windows:
            taken = min(gone, self._windows[0][1])
            self._windows[0][1] -= taken
            self._num_assigned -= taken
            gone -= taken
            if not self._windows[0][1]:
                self._windows.popleft()
        new = num_waiting - self._num_assigned
        if new:
            end = self._origin + (int((now - self._origin) // window_s) + 1) * window_s
            if self._windows and self._windows[-1][0] == end:
                self._windows[-1][1] += new
            else:
                self._windows.append([end, new])
            self._num_assigned = num_waiting
        if num_running or not self._windows or now < self._windows[0][0]:
            return 0
        count = self._windows.popleft()[1]
        self._num_assigned -= count
        return count


@dataclass(slots=True)
class Dynamic:
    """Dispatch when `max_batch` requests wait or the oldest has waited `max_wait_ms`, whichever comes first."""

    max_batch: int = 8
    max_wait_ms: float = 150.0

    def num_to_admit(self, now: float, num_waiting: int, oldest_arrival: float | None, num_running: int) -> int:
        if num_running or not num_waiting:
            return 0
        if num_waiting >= self.max_batch or now - oldest_arrival >= self.max_wait_ms / 1000:
            return min(num_waiting, self.max_batch)
        return 0


_POLICIES = {"continuous": Continuous, "serial": Serial, "fixed_window": FixedWindow, "dynamic": Dynamic}


def make_batching_policy(name: str, args: dict[str, float] | None = None):
    """Build a policy by name; `args` are its keyword arguments (window_ms, max_batch, max_wait_ms)."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown batching policy {name!r}; choose one of {', '.join(_POLICIES)}") from None
    args = dict(args or {})
    if "max_batch" in args:
        args["max_batch"] = int(args["max_batch"])
    try:
        policy = cls(**args)
    except TypeError:
        raise ConfigError(f"batching policy {name!r} does not take {sorted(args)}") from None
    for key, value in args.items():
        if value <= 0:
            raise ConfigError(f"batching policy {name!r}: {key} must be > 0, got {value}")
    return policy
