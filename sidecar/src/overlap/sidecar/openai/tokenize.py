"""vLLM's POST /tokenize and /detokenize; GET /v1/tokenizer, the tokenizer's files (for a router that scores prompts
by their tokens)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

from aiohttp import web
from jinja2 import TemplateError

from overlap.openai import schemas
from overlap.sidecar.http import json_response, read_body
from overlap.sidecar.openai import request as req
from overlap.sidecar.state import STATE, ApiError


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.TokenizeRequest)
    req.check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    try:
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await req.off_loop(len(body.prompt), state.text.encode, body.prompt, special)
        else:
            messages = schemas.chat_messages_as_dicts(body.messages)
            ids = await req.off_loop(sum(len(m["content"]) for m in messages), state.text.encode_chat, messages,
                                     body.add_generation_prompt, bool(body.add_special_tokens))  # fmt: skip
    except (ValueError, TemplateError) as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    strs = [state.text.token_text(t) for t in ids] if body.return_token_strs else None
    return json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.DetokenizeRequest)
    req.check_model(state, body.model)
    if any(not 0 <= t < state.vocab_size for t in body.tokens):
        raise ApiError(400, f"tokens must be in 0..{state.vocab_size - 1}", param="tokens")
    return json_response({"prompt": state.text.decode(body.tokens)})


async def tokenizer_files(request: web.Request) -> web.Response:
    """The files the sidecar's tokenizer was loaded from (name -> base64), as the engine reads them for a sidecar."""
    from overlap.engine.serving.server import read_tokenizer_files

    state = request.app[STATE]
    if state.text is None:
        raise ApiError(503, "the tokenizer is not loaded yet", "service_unavailable", headers={"Retry-After": "1"})
    files = await asyncio.to_thread(read_tokenizer_files, Path(state.text.model_dir))
    if not files:
        raise ApiError(404, "the tokenizer's files are too large to serve; give the router --tokenizer DIR",
                       "not_found_error")  # fmt: skip
    return json_response({"files": {name: base64.b64encode(data).decode() for name, data in files.items()}})
