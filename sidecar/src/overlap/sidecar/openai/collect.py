"""A whole (not streamed) response: every sequence read to its end, the best `n` of `best_of` kept per prompt."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from overlap.sidecar.generation import Delta
from overlap.sidecar.http import json_response
from overlap.sidecar.openai.sequences import Reply, Sequence, echoed, envelope, tool_calls, usage
from overlap.sidecar.state import ServerState


@dataclass(slots=True)
class _Collected:
    sequence: Sequence
    text: str
    token_ids: list[int]
    logprobs: list
    last: Delta
    num_echoed: int

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp[0] for lp in self.logprobs[self.num_echoed :] if lp is not None)


async def _collect_one(state: ServerState, sequence: Sequence) -> _Collected:
    parts: list[str] = []
    token_ids, logprobs, last, first = [], [], None, True
    async for delta in sequence.generation.deltas():
        if first:
            delta, first = echoed(state, delta, sequence.echo), False
        parts.append(delta.text)
        token_ids += delta.token_ids
        logprobs += delta.logprobs or [None] * len(delta.token_ids)
        last = delta
    num_echoed = len(sequence.echo) if sequence.echo is not None and token_ids else 0
    return _Collected(sequence, "".join(parts), token_ids, logprobs, last, num_echoed)


async def collect(state: ServerState, sequences: list[Sequence], reply: Reply) -> web.Response:
    tasks = [asyncio.ensure_future(_collect_one(state, s)) for s in sequences]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:  # one sequence failed (or the client left): its siblings stop now, not at their timeout
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    kept = list(results)
    if reply.best_of > reply.n:  # per prompt, the n best by cumulative logprob of what they generated
        kept = []
        for p in sorted({r.sequence.prompt_index for r in results}):
            ranked = sorted((r for r in results if r.sequence.prompt_index == p), key=lambda r: -r.cumulative_logprob)
            kept += ranked[: reply.n]
    shape, choices = reply.shape, []
    for i, r in enumerate(kept):
        lp = shape.logprobs(state.text, r.token_ids, r.logprobs, 0)[0] if reply.show_logprobs else None
        text, calls, finish_reason = r.text, None, r.last.finish_reason
        if reply.tool_setup is not None:
            text, calls = tool_calls(reply.tool_setup, r.text)
            finish_reason = "tool_calls" if calls else finish_reason
        choices.append(shape.choice(i, text, lp, finish_reason, calls))
    prompt_tokens = sum(r.last.num_prompt_tokens for r in results if r.sequence.first)
    completion_tokens = sum(r.last.num_output_tokens for r in results)  # all generated, best_of included
    data = envelope(reply, shape.object, choices)
    data["usage"] = usage(prompt_tokens, completion_tokens)
    if reply.want_timing:
        data["overlap_timing"] = results[0].last.timing
    return json_response(data)
