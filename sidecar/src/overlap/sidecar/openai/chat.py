"""POST /v1/chat/completions: messages through the model's chat template, tools and tool calls."""

from __future__ import annotations

import dataclasses
import json

from aiohttp import web
from jinja2 import TemplateError

from overlap.openai import schemas, tools
from overlap.sidecar.openai import request as req
from overlap.sidecar.openai.serving import respond
from overlap.sidecar.openai.shape import CHAT
from overlap.sidecar.state import ApiError


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival, state, body = await req.accept(request, schemas.ChatCompletionRequest)
    try:
        tool_setup = tools.setup(body.tools, body.tool_choice, state.config.tool_call_parser, body.parallel_tool_calls)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tool_choice" if body.tools else "tools") from exc
    try:
        messages = schemas.chat_messages_as_dicts(body.messages)
        shown = tool_setup.tools_for_template if tool_setup is not None else None
        # the tools render into the prompt too: a large array is as slow to template and tokenize as a long message
        size = sum(len(m["content"]) for m in messages) + (len(json.dumps(shown)) if shown else 0)
        prompt_ids = await req.off_loop(size, state.text.encode_chat, messages, True, False, shown)
    except (ValueError, TemplateError) as exc:  # e.g. a template that insists on alternating roles
        raise ApiError(400, f"cannot apply the chat template: {exc}" if isinstance(exc, TemplateError) else str(exc),
                       param="messages") from exc  # fmt: skip
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = req.sampling_params(state, body, len(prompt_ids), max_tokens)
    if tool_setup is not None and tool_setup.grammar_schema is not None:  # required / named: the grammar decides
        if sampling.grammar is not None:
            raise ApiError(400, "tool_choice 'required' or a named function cannot be combined with response_format",
                           param="tool_choice")  # fmt: skip
        schema = {**tool_setup.grammar_schema, "x-guidance": {"whitespace_flexible": False}}
        sampling = dataclasses.replace(sampling, grammar=json.dumps({"grammars": [{"json_schema": schema}]}))
    active = tool_setup if tool_setup is not None and tool_setup.active else None
    return await respond(request, state, body, CHAT, [(prompt_ids, sampling)], arrival, tool_setup=active)
