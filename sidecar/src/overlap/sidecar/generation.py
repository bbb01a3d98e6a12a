"""One request's life in the sidecar: admitted, submitted to the engine, streamed back as text deltas, accounted
for (metrics, admission) whatever way it ends, and aborted in the engine when the client goes away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from overlap.engine.serving.client import EngineRejected, EngineUnavailable
from overlap.engine.types import RequestSpec
from overlap.sidecar.detokenize import IncrementalDetokenizer
from overlap.sidecar.state import ApiError, ServerState, engine_unavailable


@dataclass(slots=True)
class Delta:
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None  # set on the last delta: "stop" | "length"
    timing: dict | None = None  # on the last delta: engine-side timestamps (time.monotonic, system-wide)
    # For a request that asked for logprobs: the tokens that arrived with this delta and their TokenLogprob
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # on the first delta of a request that asked (echo with logprobs)


class Generation:
    """One admitted, submitted request. Iterate it for deltas; it accounts for itself and aborts if abandoned."""

    def __init__(self, state: ServerState, spec: RequestSpec, stop: list[str], *, arrival: float) -> None:
        """`arrival`: when the sidecar received the request (its timeout, `spec.timeout_s`, counts from then)."""
        self.state, self.request_id, self.arrival, self.timeout_s = state, spec.request_id, arrival, spec.timeout_s
        prompt_token_ids, sampling = spec.prompt_token_ids, spec.sampling
        self.num_prompt_tokens = len(prompt_token_ids)
        admission = state.admission
        state.metrics.received.inc()  # offered load, refused or not: what the operator's forecast follows
        rejection = admission.check(len(prompt_token_ids))
        if rejection is not None:
            state.metrics.rejected_by[rejection.reason].inc()
            raise ApiError(
                429,
                rejection.message + "; retry later",
                "rate_limit_error",
                code=rejection.reason,
                headers={"Retry-After": str(rejection.retry_after_s)},
            )
        try:
            self.stream = state.client.submit(spec)
        except EngineUnavailable as exc:
            state.metrics.rejected_by["engine_unavailable"].inc()
            raise engine_unavailable() from exc
        admission.admit(spec.request_id, len(prompt_token_ids), sampling.max_tokens)
        self.detokenizer = IncrementalDetokenizer(state.text, prompt_token_ids, stop)
        self.wants_logprobs = sampling.logprobs is not None
        self.done = False
        self._closed = False

    async def deltas(self) -> AsyncIterator[Delta]:
        state, metrics = self.state, self.state.metrics
        last_token_at: float | None = None
        reason = "abort"
        num_output = 0
        try:
            async with asyncio.timeout(self.timeout_s - (time.monotonic() - self.arrival)):
                while True:
                    try:
                        out = await self.stream.next()
                    except EngineUnavailable as exc:
                        reason = "error"
                        raise ApiError(
                            503, f"{exc}; the request was lost", "service_unavailable", code="engine_unavailable"
                        ) from exc
                    except EngineRejected as exc:
                        reason = "error"
                        if exc.kind == "invalid_request":
                            raise ApiError(400, str(exc)) from exc
                        if exc.kind == "unknown_adapter":  # unloaded after the sidecar's own check let it in
                            raise ApiError(404, str(exc), code="model_not_found", param="model") from exc
                        if exc.kind == "shutting_down":
                            raise ApiError(503, str(exc), "service_unavailable", code="draining") from exc
                        raise ApiError(500, str(exc), "internal_error") from exc
                    now = time.monotonic()
                    if out.new_token_ids:
                        if last_token_at is None:
                            state.admission.started(self.request_id)
                            metrics.ttft.observe(now - self.arrival)
                        else:
                            gap = (now - last_token_at) / len(out.new_token_ids)
                            for _ in out.new_token_ids:
                                metrics.itl.observe(gap)
                        last_token_at = now
                        state.admission.progress(self.request_id, out.num_output_tokens, now)
                    num_output = out.num_output_tokens
                    text = self.detokenizer.push(out.new_token_ids)
                    new_ids, logprobs = out.new_token_ids, out.logprobs
                    kept = self.detokenizer.tokens_kept
                    if self.detokenizer.stopped and kept < len(new_ids):  # tokens past a stop string: never shown
                        num_output -= len(new_ids) - kept
                        new_ids, logprobs = new_ids[:kept], None if logprobs is None else logprobs[:kept]
                    extra = {}
                    if self.wants_logprobs and new_ids:
                        extra = {"token_ids": list(new_ids), "logprobs": logprobs}
                    if out.prompt_logprobs is not None:
                        extra["prompt_logprobs"] = out.prompt_logprobs
                    if out.finished:
                        self.done = True
                        reason = self._finish_reason(out)
                        text += self.detokenizer.flush()
                        self._observe_engine_times(out)
                        metrics.cached_prompt_tokens.inc(out.num_cached_tokens)
                        yield Delta(text, self.num_prompt_tokens, num_output, reason, self._timing(out), **extra)
                        return
                    if self.detokenizer.stopped:  # a stop string matched: the engine need not go on
                        self.done = True
                        reason = "stop"
                        state.client.abort(self.request_id)
                        yield Delta(text, self.num_prompt_tokens, num_output, "stop", **extra)
                        return
                    if text or extra:
                        yield Delta(text, self.num_prompt_tokens, num_output, **extra)
        except TimeoutError as exc:
            reason = "timeout"
            raise ApiError(
                504, f"the request timed out after {self.timeout_s:g} s", "timeout_error", code="timeout"
            ) from exc
        finally:
            self._close(reason, num_output)

    def close(self) -> None:
        """Account for a generation that was never iterated (the client went away first); idempotent."""
        self._close("abort", 0)

    def _close(self, reason: str, num_output: int) -> None:
        if self._closed:
            return
        self._closed = True
        state, metrics = self.state, self.state.metrics
        if not self.done:
            state.client.abort(self.request_id)  # client gone, timed out, or failed: free the engine's slot
        state.admission.finished(self.request_id)
        metrics.finished_by[reason].inc()
        metrics.e2e.observe(time.monotonic() - self.arrival)
        metrics.prompt_tokens.inc(self.num_prompt_tokens)
        metrics.generation_tokens.inc(num_output)

    def _finish_reason(self, out) -> str:
        reason = out.finish_reason
        if self.detokenizer.stopped or reason == "stop":
            return "stop"
        if reason == "length":
            return "length"
        if reason == "timeout":
            raise TimeoutError  # queued past its deadline in the engine
        if reason == "abort":
            raise ApiError(503, "the engine aborted the request", "service_unavailable", code="aborted")
        raise ApiError(500, f"the engine failed on this request: {out.error or reason}", "internal_error")

    def _observe_engine_times(self, out) -> None:
        t = out.times
        if t is None:
            return
        if t.first_scheduled is not None:
            self.state.metrics.queue_time.observe(max(0.0, t.first_scheduled - t.arrived))
            if t.first_token is not None:
                self.state.metrics.prefill_time.observe(max(0.0, t.first_token - t.first_scheduled))

    def _timing(self, out) -> dict | None:
        t = out.times
        if t is None:
            return None
        return {
            "sidecar_arrived": self.arrival,
            "sidecar_final_received": time.monotonic(),
            "engine_arrived": t.arrived,
            "engine_first_scheduled": t.first_scheduled,
            "engine_first_token": t.first_token,
            "engine_finished": t.finished,
            "num_preemptions": t.num_preemptions,
        }
