"""POST /v1/completions: one or several prompts (text or token ids), `echo`, `n` / `best_of`."""

from __future__ import annotations

from aiohttp import web

from overlap.openai import schemas
from overlap.sidecar.openai import request as req
from overlap.sidecar.openai.serving import respond
from overlap.sidecar.openai.shape import COMPLETION

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions (chat's is what the context leaves)


async def completions(request: web.Request) -> web.StreamResponse:
    arrival, state, body = await req.accept(request, schemas.CompletionRequest)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    prompts = []
    for prompt in req.split_prompts(body.prompt):
        ids = await req.prompt_ids(state, prompt)
        prompts.append((ids, req.sampling_params(state, body, len(ids), max_tokens, echo=body.echo)))
    return await respond(request, state, body, COMPLETION, prompts, arrival, echo=body.echo)
