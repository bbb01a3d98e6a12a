"""Admission control: shed load before any engine work instead of queueing forever (field report 2).

A request is *queued* from admission until its first output arrives, and *in flight* until it finishes. Past the
high watermark on queued requests, on their prompt tokens, or on in-flight requests, a new request is refused
with a `Retry-After`: when the requests in flight are expected to have freed enough room. Each request's finish is
expected after its remaining tokens at its own pace so far (one that has not produced two tokens yet: at the
recent finished requests' pace), counting no further than the longest output of the recent finished requests (most
stop at an EOS well before their `max_tokens`); before any pace is known, from how fast requests finished lately.
Whole seconds, rounded: 0 when room is expected within half a second (RFC 9110 allows it).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass
from statistics import median

_RATE_WINDOW_S = 10.0  # drain rate = requests finished over the last window
_MAX_RETRY_AFTER_S = 60
_RECENT_LENGTHS = 64  # finished requests whose output lengths bound the expected ones


@dataclass(slots=True)
class _Progress:
    """An in-flight request's output so far: what its expected finish is computed from."""

    max_tokens: int
    first_token_at: float | None = None
    last_token_at: float = 0.0
    num_output: int = 0


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
        self._inflight: dict[str, _Progress] = {}
        self.num_queued_tokens = 0
        self._finish_times: deque[float] = deque()
        self._recent_lengths: deque[int] = deque(maxlen=_RECENT_LENGTHS)
        self._recent_paces: deque[float] = deque(maxlen=_RECENT_LENGTHS)  # seconds per token of finished requests

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

    def admit(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
        self._queued[request_id] = num_prompt_tokens
        self.num_queued_tokens += num_prompt_tokens
        self._inflight[request_id] = _Progress(max_tokens)

    def started(self, request_id: str) -> None:
        """Its first output arrived: it no longer counts as queued."""
        tokens = self._queued.pop(request_id, None)
        if tokens is not None:
            self.num_queued_tokens -= tokens

    def progress(self, request_id: str, num_output: int, now: float) -> None:
        """It has produced `num_output` tokens so far."""
        progress = self._inflight.get(request_id)
        if progress is not None:
            if progress.first_token_at is None:
                progress.first_token_at = now
            progress.last_token_at = now
            progress.num_output = num_output

    def finished(self, request_id: str) -> None:
        self.started(request_id)
        progress = self._inflight.pop(request_id, None)
        if progress is not None:
            self._finish_times.append(time.monotonic())
            if progress.num_output:
                self._recent_lengths.append(progress.num_output)
            if progress.num_output >= 2:
                self._recent_paces.append(_pace(progress))

    def drain_rate(self) -> float:
        """Requests finished per second over the recent window (0 when nothing finished lately)."""
        now = time.monotonic()
        while self._finish_times and now - self._finish_times[0] > _RATE_WINDOW_S:
            self._finish_times.popleft()
        if not self._finish_times:
            return 0.0
        return len(self._finish_times) / _RATE_WINDOW_S

    def expected_wait_s(self, excess: int, now: float | None = None) -> float | None:
        """Seconds until `excess` requests in flight are expected to have finished; None if nothing tells."""
        now = time.monotonic() if now is None else now
        longest = max(self._recent_lengths, default=None)
        recent_pace = median(self._recent_paces) if self._recent_paces else None
        remaining = []
        for p in self._inflight.values():
            pace = _pace(p) if p.num_output >= 2 else recent_pace
            if pace is None:
                continue  # nothing tells how fast it goes
            expected = p.max_tokens if longest is None else min(p.max_tokens, longest)
            since = now - p.last_token_at if p.first_token_at is not None else 0.0
            remaining.append(max(max(expected - p.num_output, 1) * pace - since, 0.0))
        if len(remaining) >= excess:
            return heapq.nsmallest(excess, remaining)[-1]
        rate = self.drain_rate()
        return excess / rate if rate > 0 else None

    def _retry(self, excess: int) -> int:
        """Retry-After: whole seconds (RFC 9110), the expected wait rounded (0: within half a second)."""
        wait = self.expected_wait_s(excess)
        if wait is None:
            return 1  # nothing measured yet: ask again soon
        return min(_MAX_RETRY_AFTER_S, round(wait))


def _pace(progress: _Progress) -> float:
    """Seconds per output token since its first (needs two tokens)."""
    return (progress.last_token_at - progress.first_token_at) / (progress.num_output - 1)
