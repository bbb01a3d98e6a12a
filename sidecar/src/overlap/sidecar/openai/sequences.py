"""A request's sequences (each prompt's `n` choices, `best_of` of them generated) and what answering them needs:
the reply's identity and shape, the echoed prompt, tool calls, usage, the response envelope."""

from __future__ import annotations

import time
from dataclasses import dataclass

from overlap.openai.tools import ToolSetup
from overlap.openai.tools import extract as extract_tool_calls
from overlap.sidecar.generation import Delta, Generation
from overlap.sidecar.openai.shape import CompletionShape
from overlap.sidecar.state import ServerState


@dataclass(slots=True)
class Sequence:
    """One of a request's sequences: of prompt `prompt_index`, choice `index` (streamed as is; best_of renumbers)."""

    index: int
    prompt_index: int
    generation: Generation
    echo: list[int] | None  # the prompt's ids when the completion echoes it
    first: bool  # the prompt's first sequence (usage counts each prompt once)


@dataclass(slots=True)
class Reply:
    """What one request's answer needs besides its sequences."""

    request_id: str
    model: str
    shape: CompletionShape
    n: int
    best_of: int
    show_logprobs: bool
    want_timing: bool
    tool_setup: ToolSetup | None  # chat with tools: each sequence's text becomes calls at its end


def echoed(state: ServerState, delta: Delta, echo: list[int] | None) -> Delta:
    """The first delta with the prompt in front: its text, and its tokens with their logprobs (the first None)."""
    if echo is None:
        return delta
    delta.text = state.text.decode(echo) + delta.text
    if delta.prompt_logprobs is not None or delta.logprobs is not None:
        prompt_lps = delta.prompt_logprobs or [None] * len(echo)
        delta.token_ids = list(echo) + delta.token_ids
        delta.logprobs = list(prompt_lps) + (delta.logprobs or [None] * (len(delta.token_ids) - len(echo)))
    return delta


def tool_calls(tool_setup: ToolSetup, text: str) -> tuple[str | None, list[dict]]:
    """(content, calls); output a grammar could not finish (max_tokens came first) stays text, with no call."""
    try:
        return extract_tool_calls(tool_setup, text)
    except (ValueError, KeyError, TypeError):
        return text, []


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def envelope(reply: Reply, object_name: str, choices: list[dict], created: int | None = None) -> dict:
    """A response or chunk around its choices."""
    created = int(time.time()) if created is None else created
    return {"id": reply.request_id, "object": object_name, "created": created, "model": reply.model, "choices": choices}
