"""Waiting requests (layer 1): FIFO, or priority levels with aging, behind one `RequestQueue` interface.

Levels run from 0 (highest) to num_levels - 1; within a level requests leave in the order they entered it. With
aging, a request that has sat in its level for `aging_s` moves up one level (and again after another `aging_s`),
so under a steady stream of high-priority work a low-priority request still reaches level 0 after
(priority * aging_s) and is then served in FIFO order with the rest of level 0: it never starves.

A preempted request goes back to the *front* of the level it left, so it resumes before anything that queued
after it. Deadlines apply to requests that have not been scheduled yet: `pop_expired(now)` hands back the ones
whose deadline has passed so the engine can finish them with reason `timeout` (a preempted request has already
been served and keeps its place instead).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from overlap.engine.errors import ConfigError
from overlap.engine.requests.request import Request


class RequestQueue:
    """Levels of insertion-ordered dicts keyed by request id: O(1) add, add-front, pop and remove-by-id."""

    def __init__(self, num_levels: int, aging_s: float | None, num_priorities: int | None = None) -> None:
        assert num_levels >= 1, "a queue needs at least one level"
        self.num_levels = num_levels
        self._aging_s = aging_s  # None: no aging
        self.num_priorities = num_priorities or num_levels  # for the per-priority counts in stats
        self._levels: list[OrderedDict[str, Request]] = [OrderedDict() for _ in range(num_levels)]
        self._level_of: dict[str, int] = {}
        self._num_by_priority = [0] * self.num_priorities
        self._deadlines: list[tuple[float, int, Request]] = []  # heap; stale entries skipped lazily
        # every queued request's arrival time, kept sorted for the batching policy (new arrivals are the latest,
        # so insort appends; a pop deletes near the front: a memmove of pointers, cheap at thousands)
        self._arrivals: list[float] = []
        self._next_aging_check = 0.0  # no request can qualify for promotion before this time

    @property
    def aging_s(self) -> float | None:
        return self._aging_s

    @aging_s.setter
    def aging_s(self, value: float | None) -> None:
        self._aging_s = value
        self._next_aging_check = 0.0  # rescan under the new period

    # ---- policy hooks ------------------------------------------------------------------------------------------
    def _initial_level(self, request: Request) -> int:
        return min(request.priority, self.num_levels - 1)

    # ---- adding and removing -----------------------------------------------------------------------------------
    def add(self, request: Request, now: float) -> None:
        """A new request: the back of the level its priority names."""
        level = self._initial_level(request)
        self._insert(request, level, now, front=False)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.arrival_seq, request))

    def add_front(self, request: Request, now: float) -> None:
        """A preempted request: the front of the level it was popped from, ahead of everything queued since."""
        self._insert(request, min(request.queue_level, self.num_levels - 1), now, front=True)

    def _insert(self, request: Request, level: int, now: float, front: bool) -> None:
        rid = request.request_id
        assert rid not in self._level_of, f"request {rid} is already queued"
        request.queue_level = level
        request.level_entered = now
        self._levels[level][rid] = request
        if level > 0 and self._aging_s is not None:
            self._next_aging_check = min(self._next_aging_check, now + self._aging_s)
        if front:
            self._levels[level].move_to_end(rid, last=False)
        self._level_of[rid] = level
        self._num_by_priority[min(request.priority, self.num_priorities - 1)] += 1
        insort(self._arrivals, request.times.arrived)

    def peek(self) -> Request | None:
        for level in self._levels:
            if level:
                return next(iter(level.values()))
        return None

    def pop(self) -> Request:
        for level in self._levels:
            if level:
                _, request = level.popitem(last=False)
                self._forget(request)
                return request
        raise IndexError("pop from an empty RequestQueue")

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (abort); None if it is not queued."""
        level = self._level_of.get(request_id)
        if level is None:
            return None
        request = self._levels[level].pop(request_id)
        self._forget(request)
        return request

    def _forget(self, request: Request) -> None:
        del self._level_of[request.request_id]
        self._num_by_priority[min(request.priority, self.num_priorities - 1)] -= 1
        del self._arrivals[bisect_left(self._arrivals, request.times.arrived)]

    # ---- time-driven changes -----------------------------------------------------------------------------------
    def pop_expired(self, now: float) -> list[Request]:
        """Remove and return the never-scheduled requests whose deadline is at or before `now`."""
        expired = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, request = heapq.heappop(heap)
            queued = self._level_of.get(request.request_id) is not None
            if queued and request.times.first_scheduled is None and self.remove(request.request_id) is request:
                expired.append(request)
        return expired

    def update(self, now: float) -> int:
        """Apply aging; returns how many requests moved up. Scans only when some request is due (and at most 100
        times per `aging_s`), so its cost does not grow with the step rate."""
        if self._aging_s is None or self.num_levels == 1 or now < self._next_aging_check:
            return 0
        aging_s = self._aging_s
        moves = []
        next_due = float("inf")
        for level_index in range(1, self.num_levels):
            for request in self._levels[level_index].values():
                due = request.level_entered + aging_s
                if due <= now:
                    moves.append(request)
                else:
                    next_due = min(next_due, due)
        for request in moves:
            del self._levels[request.queue_level][request.request_id]
            while request.queue_level > 0 and now - request.level_entered >= aging_s:
                request.queue_level -= 1
                request.level_entered += aging_s  # the moment it qualified: independent of the scan rate
            if request.queue_level > 0:
                next_due = min(next_due, request.level_entered + aging_s)
        # Keep each level ordered by when its members entered it.
        moves.sort(key=lambda r: (r.level_entered, r.arrival_seq))
        for request in moves:
            self._levels[request.queue_level][request.request_id] = request
            self._level_of[request.request_id] = request.queue_level
        self._next_aging_check = max(next_due, now + aging_s / 100)
        return len(moves)

    # ---- inspection --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._level_of)

    def __bool__(self) -> bool:
        return bool(self._level_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._level_of

    def __iter__(self) -> Iterator[Request]:
        """In the order `pop` would return them."""
        for level in self._levels:
            yield from level.values()

    def arrival_times(self) -> Sequence[float]:
        """The queued requests' arrival times, oldest first (what a batching policy reads; do not modify)."""
        return self._arrivals

    def num_by_priority(self) -> list[int]:
        return list(self._num_by_priority)

    def num_by_level(self) -> list[int]:
        return [len(level) for level in self._levels]


class FifoRequestQueue(RequestQueue):
    """First come, first served: one level, priorities ignored for ordering, no aging."""

    def __init__(self, num_priorities: int) -> None:
        super().__init__(num_levels=1, aging_s=None, num_priorities=num_priorities)

    def _initial_level(self, request: Request) -> int:
        return 0


class PriorityRequestQueue(RequestQueue):
    """`num_levels` priority levels (0 is the highest), FIFO within a level, aging after `aging_s`."""

    def __init__(self, num_levels: int, aging_s: float) -> None:
        super().__init__(num_levels=num_levels, aging_s=aging_s)


def make_request_queue(policy: str, num_priority_levels: int, aging_s: float) -> RequestQueue:
    if policy == "fifo":
        return FifoRequestQueue(num_priorities=num_priority_levels)
    if policy == "priority":
        return PriorityRequestQueue(num_levels=num_priority_levels, aging_s=aging_s)
    raise ConfigError(f"unknown queue policy {policy!r}; choose priority or fifo")
