"""Batching policies: how many waiting requests the scheduler may admit at a step boundary.

Field report 2 compared four policies on the same model and runner; the engine replays that experiment by
swapping this one object. `continuous` admits whenever there is room (the scheduler's token budget, sequence cap
and KV pool still apply). The other three batch whole requests and let the batch run until every member has
finished before the next batch starts, as static batching does, so head-of-line blocking shows up as it does in
practice.

The contract: at every step that has room, the scheduler calls `num_to_admit(now, arrivals, num_running)` with
`arrivals` the waiting requests' arrival times (the engine's clock), sorted oldest first: a read-only view the
queue keeps sorted as requests come and go, so the call costs O(1) or one bisection. A policy decides how many
requests start; which ones is the waiting queue's order (its head first).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from overlap.engine.errors import ConfigError


class BatchingPolicy(Protocol):
    def num_to_admit(self, now: float, arrivals: Sequence[float], num_running: int) -> int: ...


@dataclass(slots=True)
class Continuous:
    def num_to_admit(self, now: float, arrivals: Sequence[float], num_running: int) -> int:
        return len(arrivals)


@dataclass(slots=True)
class Serial:
    """One request at a time."""

    def num_to_admit(self, now: float, arrivals: Sequence[float], num_running: int) -> int:
        return 1 if num_running == 0 and arrivals else 0


@dataclass(slots=True)
class FixedWindow:
    """Time-window batching: the clock is cut into windows of `window_ms` from the first arrival; the requests
    that arrived in one window form one batch, dispatched once that window has closed and the device is free.
    Batches go out in window order, oldest first, while the device works through a backlog, so the batch size
    follows the arrival rate (rate x window), not the backlog: under load this is the conservative policy field
    report 2 measured. The oldest window that still holds a waiting request is the next batch (requests the
    scheduler could not admit with their window's batch go out together after it)."""

    window_ms: float = 50.0
    _origin: float | None = None  # start of window 0: the first arrival seen

    def num_to_admit(self, now: float, arrivals: Sequence[float], num_running: int) -> int:
        if not arrivals:
            return 0
        if self._origin is None:
            self._origin = arrivals[0]
        if num_running:
            return 0
        window_s = self.window_ms / 1000
        end = self._origin + (math.floor((arrivals[0] - self._origin) / window_s) + 1) * window_s
        if now < end:
            return 0
        # at least the oldest one, in case rounding put the window's end at or before its arrival
        return max(1, bisect_left(arrivals, end))


@dataclass(slots=True)
class Dynamic:
    """Dispatch when `max_batch` requests wait or the oldest has waited `max_wait_ms`, whichever comes first."""

    max_batch: int = 8
    max_wait_ms: float = 150.0

    def num_to_admit(self, now: float, arrivals: Sequence[float], num_running: int) -> int:
        if num_running or not arrivals:
            return 0
        if len(arrivals) >= self.max_batch or now - arrivals[0] >= self.max_wait_ms / 1000:
            return min(len(arrivals), self.max_batch)
        return 0


_POLICIES = {"continuous": Continuous, "serial": Serial, "fixed_window": FixedWindow, "dynamic": Dynamic}


def make_batching_policy(name: str, args: dict[str, float] | None = None) -> BatchingPolicy:
    """Build a policy by name; `args` are its keyword arguments (window_ms, max_batch, max_wait_ms)."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown batching policy {name!r}; choose one of {', '.join(_POLICIES)}") from None
    args = dict(args or {})
    if any(key.startswith("_") for key in args):
        raise ConfigError(f"batching policy {name!r} does not take {sorted(args)}")
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
