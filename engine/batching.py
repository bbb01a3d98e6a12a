"""Batching policies: how many waiting requests the scheduler may admit at a step boundary.

Field report 2 compared four policies on the same model and runner; the engine replays that experiment by
swapping this one object. `continuous` admits whenever there is room (the scheduler's token budget, sequence cap
and KV pool still apply). The other three batch whole requests and let the batch run until every member has
finished before the next batch starts, as static batching does, so head-of-line blocking shows up as it does in
practice.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Collect arrivals for `window_ms`, then dispatch all of them as one batch once the device is free."""

    window_ms: float = 50.0
    _next_dispatch: float | None = None

    def num_to_admit(self, now: float, num_waiting: int, oldest_arrival: float | None, num_running: int) -> int:
        if num_running or not num_waiting:
            return 0
        if self._next_dispatch is None:  # the first window opens with the first arrival
            self._next_dispatch = oldest_arrival + self.window_ms / 1000
        if now < self._next_dispatch:
            return 0
        self._next_dispatch = now + self.window_ms / 1000
        return num_waiting


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
