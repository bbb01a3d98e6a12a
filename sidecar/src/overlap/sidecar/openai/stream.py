"""A streamed response (server-sent events): one chunk per delta of each sequence, in arrival order; under tools a
sequence's text is held until it ends and then sent as content and calls; usage at the end when asked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from overlap.openai import schemas
from overlap.sidecar.generation import Delta
from overlap.sidecar.http import encode_json
from overlap.sidecar.openai.sequences import Reply, Sequence, echoed, envelope, tool_calls, usage
from overlap.sidecar.state import ApiError, ServerState

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"

log = logging.getLogger(__name__)


def sse(data) -> bytes:
    return b"data: " + encode_json(data) + b"\n\n"


# (sequence, delta, None) per delta, (sequence, None, None) at its end, (sequence, None, error) on a failure.
Event = tuple[Sequence, Delta | None, ApiError | None]


async def _events(state: ServerState, seq: Sequence) -> AsyncIterator[Event]:
    first = True
    try:
        async for delta in seq.generation.deltas():
            if first:
                delta, first = echoed(state, delta, seq.echo), False
            yield seq, delta, None
    except ApiError as exc:
        yield seq, None, exc
        return
    except Exception as exc:  # a bug past the engine (the detokenizer's, say): this sequence ends with an error
        # event, and its siblings of the same request (n > 1) go on, instead of the stream waiting for it forever
        log.exception("sequence %s of a stream failed", seq.index)
        yield seq, None, ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error",
                                 code="internal_error")  # fmt: skip
        return
    yield seq, None, None


class _Merged:
    """Every sequence's events in arrival order. One sequence (the usual request) is read in place; several are
    pumped into one queue: a task and a queue hand-off per streamed token, which a single sequence does not need."""

    def __init__(self, state: ServerState, sequences: list[Sequence]) -> None:
        self._pumps: list[asyncio.Task] = []
        self._source = None
        if len(sequences) == 1:
            self._source = _events(state, sequences[0])
            self.next = self._source.__anext__
        else:
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(seq: Sequence) -> None:
                async for event in _events(state, seq):
                    await queue.put(event)

            self._pumps = [asyncio.create_task(pump(seq)) for seq in sequences]
            self.next = queue.get

    async def close(self) -> None:
        if self._source is not None:
            # a client gone mid-stream: the generation's own cleanup aborts it in the engine
            await self._source.aclose()
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


class _Chunks:
    """The stream's chunks in the reply's shape."""

    def __init__(self, state: ServerState, reply: Reply, options: schemas.StreamOptions) -> None:
        self.state, self.reply, self.options = state, reply, options
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}

    def chunk(self, seq: Sequence, text: str | None, finish_reason: str | None, delta: Delta | None,
              first: bool = False) -> bytes:  # fmt: skip
        lp = None
        if delta is not None and self.reply.show_logprobs:
            offset = self.text_offsets.get(seq.index, 0)
            lp, self.text_offsets[seq.index] = self.reply.shape.logprobs(self.state.text, delta.token_ids,
                                                                         delta.logprobs, offset)  # fmt: skip
        choice = self.reply.shape.chunk_choice(seq.index, text, lp, finish_reason, first)
        data = envelope(self.reply, self.reply.shape.chunk_object, [choice], self.created)
        if self.options.include_usage:
            continuous = self.options.continuous_usage_stats and delta is not None
            data["usage"] = usage(delta.num_prompt_tokens, delta.num_output_tokens) if continuous else None
        return sse(data)

    def tools(self, seq: Sequence, text: str, delta: Delta) -> list[bytes]:
        """A finished sequence under tools: its text, then each call whole, in OpenAI's delta shape."""
        content, calls = tool_calls(self.reply.tool_setup, text)
        out = [self.chunk(seq, content, None, None)] if content else []
        if calls:
            call_deltas = [{"index": k, **call} for k, call in enumerate(calls)]
            choice = {"index": seq.index, "delta": {"tool_calls": call_deltas}, "logprobs": None, "finish_reason": None}
            out.append(sse(envelope(self.reply, self.reply.shape.chunk_object, [choice], self.created)))
        out.append(self.chunk(seq, None, "tool_calls" if calls else delta.finish_reason, delta))
        return out

    def final_usage(self, sequences: list[Sequence], lasts: dict[int, Delta]) -> bytes:
        prompt_tokens = sum(lasts[s.index].num_prompt_tokens for s in sequences if s.first and s.index in lasts)
        data = envelope(self.reply, self.reply.shape.chunk_object, [], self.created)
        data["usage"] = usage(prompt_tokens, sum(d.num_output_tokens for d in lasts.values()))
        if self.reply.want_timing:
            data["overlap_timing"] = next(iter(lasts.values())).timing
        return sse(data)


async def stream(request: web.Request, state: ServerState, body, sequences: list[Sequence],
                 reply: Reply) -> web.StreamResponse:  # fmt: skip
    options = body.stream_options or schemas.StreamOptions()
    chunks = _Chunks(state, reply, options)
    events = _Merged(state, sequences)
    buffered: dict[int, str] = {}  # under tools: each sequence's text until it ends
    lasts: dict[int, Delta] = {}
    remaining = len(sequences)
    try:
        # The first delta comes before the headers, so a request the engine refuses still gets its 4xx/5xx status.
        seq, delta, error = await events.next()
        if error is not None:
            raise error
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        try:
            if reply.shape.opens_with_role:
                for s in sequences:
                    await response.write(chunks.chunk(s, "", None, None, first=True))
            while True:
                if error is not None:
                    raise error
                if delta is None:
                    remaining -= 1
                    if remaining == 0:
                        break
                elif reply.tool_setup is not None:
                    lasts[seq.index] = delta
                    buffered[seq.index] = buffered.get(seq.index, "") + delta.text
                    if delta.finish_reason is not None:
                        for data in chunks.tools(seq, buffered[seq.index], delta):
                            await response.write(data)
                else:
                    lasts[seq.index] = delta
                    await response.write(chunks.chunk(seq, delta.text, delta.finish_reason, delta))
                seq, delta, error = await events.next()
        except ApiError as exc:  # the headers are sent already: report the error in the stream
            await response.write(sse(exc.body()))
            await response.write(DONE)
            await response.write_eof()
            return response
    finally:
        await events.close()
    if options.include_usage:
        await response.write(chunks.final_usage(sequences, lasts))
    await response.write(DONE)
    await response.write_eof()
    return response
