"""Serving one OpenAI request: its sequences generated in the engine (the sequences of one prompt share its computed KV
blocks there), then answered whole (`collect`) or streamed (`stream`)."""

from __future__ import annotations

import dataclasses
import uuid

from aiohttp import web

from overlap.engine.types import RequestSpec, SamplingParams
from overlap.openai import schemas
from overlap.openai.tools import ToolSetup
from overlap.sidecar.generation import Generation
from overlap.sidecar.openai import request as req
from overlap.sidecar.openai.collect import collect
from overlap.sidecar.openai.sequences import Reply, Sequence
from overlap.sidecar.openai.shape import CompletionShape
from overlap.sidecar.openai.stream import stream
from overlap.sidecar.state import ApiError, ServerState


async def respond(request: web.Request, state: ServerState, body: schemas._Common, shape: CompletionShape,
                  prompts: list[tuple[list[int], SamplingParams]], arrival: float, *, echo: bool = False,
                  tool_setup: ToolSetup | None = None) -> web.StreamResponse:  # fmt: skip
    """Generate every prompt's sequences and answer (streamed when the body asks). `echo`: completions start with
    the prompt."""
    stop = req.stop_strings(body)
    priority = req.priority(state, request, body.priority)
    timeout_s = req.timeout(state, request, body.timeout)
    n, best_of = body.n, getattr(body, "best_of", None) or body.n
    cap = state.config.max_n
    if not 1 <= n <= cap:
        raise ApiError(400, f"n must be in 1..{cap} (the server's --max-n)", param="n")
    if not n <= best_of <= cap:
        raise ApiError(400, f"best_of must be in n..{cap}, got {best_of}", param="best_of")
    if best_of > n and body.stream:
        raise ApiError(400, "best_of > n cannot be streamed (the best ones are known only at the end)", param="best_of")
    lora = req.lora_name(state, body.model)  # the request's model picks the adapter, and answers as it
    reply = Reply(f"{shape.id_prefix}-{uuid.uuid4().hex}", lora or state.model_name, shape, n, best_of,
                  prompts[0][1].logprobs is not None, request.headers.get("x-overlap-timing") == "1",
                  tool_setup)  # fmt: skip
    sequences: list[Sequence] = []
    try:
        for p, (ids, sampling) in enumerate(prompts):
            first_id = None
            for j in range(best_of):
                seq_sampling = sampling
                if sampling.seed is not None and j:  # distinct, reproducible, and still a signed 64-bit seed
                    seed = (sampling.seed + j + 2**63) % 2**64 - 2**63
                    seq_sampling = dataclasses.replace(seq_sampling, seed=seed)
                if best_of > n and sampling.logprobs is None:
                    seq_sampling = dataclasses.replace(seq_sampling, logprobs=0)  # ranking needs each token's
                seq_id = reply.request_id if len(prompts) == 1 and best_of == 1 else f"{reply.request_id}-{p}-{j}"
                spec = RequestSpec(seq_id, ids, seq_sampling, priority, timeout_s, share_prompt_with=first_id,
                                   lora_name=lora)  # fmt: skip
                generation = Generation(state, spec, stop, arrival=arrival)
                first_id = first_id or seq_id
                sequences.append(Sequence(p * best_of + j, p, generation, ids if echo else None, j == 0))
        if body.stream:
            return await stream(request, state, body, sequences, reply)
        return await collect(state, sequences, reply)
    finally:
        for sequence in sequences:  # a refusal half-way aborts the siblings already submitted
            sequence.generation.close()
