"""Admission control: shed load before any engine work instead of queueing forever (field report 2).

A request is *queued* from admission until its first output arrives, and *in flight* until it finishes. Past the
high watermark on queued requests, on their prompt tokens, or on in-flight requests, a new request is refused
with a `Retry-After` computed from how fast requests are currently draining.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

_RATE_WINDOW_S = 10.0  # drain rate = requests finished over the last window
_MAX_RETRY_AFTER_S = 60


@dataclass(slots=True, frozen=True)
class Rejection:
    reason: str  # queued_requests | queued_tokens | inflight
    message: str
    retry_after_s: int


class Admission:
    def __init__(self, max_queued_requests: int, max_queued_tokens: int, max_inflight: int) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.max_inflight = max_inflight
        self._queued: dict[str, int] = {}  # request id -> prompt tokens, until its first output
        self._inflight: set[str] = set()
        self.num_queued_tokens = 0
        self._finish_times: deque[float] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def check(self, num_prompt_tokens: int) -> Rejection | None:
        """Why a request of this size cannot be admitted now, or None if it can."""
        if len(self._inflight) >= self.max_inflight:
            excess = len(self._inflight) - self.max_inflight + 1
            return Rejection("inflight", f"server busy: {len(self._inflight)} requests in flight", self._retry(excess))
        if len(self._queued) >= self.max_queued_requests:
            excess = len(self._queued) - self.max_queued_requests + 1
            return Rejection(
                "queued_requests", f"server busy: {len(self._queued)} requests queued", self._retry(excess)
            )
        # A prompt larger than the token watermark on its own still gets in when nothing else is queued.
        if self._queued and self.num_queued_tokens + num_prompt_tokens > self.max_queued_tokens:
            return Rejection(
                "queued_tokens", f"server busy: {self.num_queued_tokens} prompt tokens queued", self._retry(1)
            )
        return None

    def admit(self, request_id: str, num_prompt_tokens: int) -> None:
        self._queued[request_id] = num_prompt_tokens
        self.num_queued_tokens += num_prompt_tokens
        self._inflight.add(request_id)

    def started(self, request_id: str) -> None:
        """Its first output arrived: it no longer counts as queued."""
        tokens = self._queued.pop(request_id, None)
        if tokens is not None:
            self.num_queued_tokens -= tokens

    def finished(self, request_id: str) -> None:
        self.started(request_id)
        if request_id in self._inflight:
            self._inflight.discard(request_id)
            self._finish_times.append(time.monotonic())

    def drain_rate(self) -> float:
        """Requests finished per second over the recent window (0 when nothing finished lately)."""
        now = time.monotonic()
        while self._finish_times and now - self._finish_times[0] > _RATE_WINDOW_S:
            self._finish_times.popleft()
        if not self._finish_times:
            return 0.0
        return len(self._finish_times) / _RATE_WINDOW_S

    def _retry(self, excess: int) -> int:
        rate = self.drain_rate()
        if rate <= 0:
            return 1  # nothing measured yet: ask again soon
        return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(excess / rate)))
