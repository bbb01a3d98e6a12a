"""Requests held until an upstream is ready: the waiting room of the activator (its one upstream) and of the router
(any replica), so that a service at zero replicas, or with none ready, holds requests instead of refusing them."""

from __future__ import annotations

import asyncio
import time


class WaitingRoom:
    """Requests waiting for `ready` to be set: `count` of them (each server exports it as a gauge the operator scales
    from zero on), at most `limit`. A request waits until the event is set or its deadline passes."""

    def __init__(self, ready: asyncio.Event, limit: int) -> None:
        self.ready = ready
        self.limit = limit
        self.count = 0

    def full(self) -> bool:
        return self.count >= self.limit

    async def wait(self, deadline: float) -> bool:
        """True once `ready` is set (at once when it is); False when the deadline (time.monotonic()) comes first."""
        if self.ready.is_set():
            return True
        self.count += 1
        try:
            await asyncio.wait_for(self.ready.wait(), timeout=max(0.0, deadline - time.monotonic()))
            return True
        except TimeoutError:
            return False
        finally:
            self.count -= 1

    async def pause(self, seconds: float) -> None:
        """Hold a request for `seconds` (before it is tried again), counted among the waiting."""
        self.count += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.count -= 1
