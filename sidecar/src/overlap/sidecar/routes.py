"""HTTP handlers of the public port: the OpenAI API, health, metrics and the OpenAPI document."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
from aiohttp import web
from jinja2 import TemplateError

from overlap.engine.errors import InvalidRequestError
from overlap.engine.types import SamplingParams
from overlap.sidecar import schemas
from overlap.sidecar.generation import Delta, Generation
from overlap.sidecar.logprobs import chat_logprobs, completion_logprobs
from overlap.sidecar.state import STATE, ApiError, ServerState, engine_unavailable

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_json = msgspec.json.Encoder()
_INLINE_TOKENIZE_CHARS = 16 * 1024


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json", headers=headers)


async def read_body(request: web.Request, kind: type):
    """Decode and type-check a JSON body; every failure is a 400 naming what is wrong."""
    body = await request.read()  # over client_max_size: 413 from aiohttp, rendered by the error middleware
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        raise ApiError(400, f"invalid request: {message}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "the request body is nested too deeply") from exc


# ---- shared preparation ----------------------------------------------------------------------------------------


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {state.model_name!r}",
            code="model_not_found",
            param="model",
        )


def _priority(state: ServerState, request: web.Request, body_priority: int | None) -> int:
    value: object = body_priority
    if value is None and "x-priority" in request.headers:
        try:
            value = int(request.headers["x-priority"])
        except ValueError as exc:
            raise ApiError(400, "the x-priority header must be an integer", param="priority") from exc
    if value is None:
        return min(1, state.num_priority_levels - 1)
    if not 0 <= value < state.num_priority_levels:
        raise ApiError(
            400, f"priority must be in 0..{state.num_priority_levels - 1} (0 is the highest)", param="priority"
        )
    return value


def _timeout(state: ServerState, request: web.Request, body_timeout: float | None) -> float:
    value = body_timeout
    if value is None and "x-request-timeout" in request.headers:
        try:
            value = float(request.headers["x-request-timeout"])
        except ValueError as exc:
            raise ApiError(400, "the x-request-timeout header must be a number of seconds", param="timeout") from exc
    if value is None:
        return state.config.request_timeout_s
    if not value > 0:
        raise ApiError(400, "timeout must be a positive number of seconds", param="timeout")
    return min(value, state.config.request_timeout_s)  # a request may only lower the server's timeout


def _sampling(state: ServerState, body: schemas._Common, num_prompt: int, max_tokens: int | None) -> SamplingParams:
    unsupported = body.unsupported_fields()
    if unsupported:
        raise ApiError(400, f"not supported by this server: {', '.join(unsupported)}", param=unsupported[0])
    room = state.max_model_len - num_prompt
    if room <= 0:
        raise ApiError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, your prompt has "
            f"{num_prompt} tokens, leaving no room for a completion.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    elif num_prompt + max_tokens > state.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    stop_ids = body.stop_token_ids or []
    if any(not 0 <= t < state.vocab_size for t in stop_ids):
        raise ApiError(400, f"stop_token_ids must be in 0..{state.vocab_size - 1}", param="stop_token_ids")
    try:
        logprobs = body.logprobs_wanted()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="top_logprobs") from exc
    # echo with logprobs scores the prompt too (what evaluation harnesses read as log-likelihoods)
    prompt_logprobs = logprobs if getattr(body, "echo", False) and logprobs is not None else None
    controls = _logits_controls(state, body)
    try:
        controls["grammar"] = schemas.structured_output_grammar(body)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ApiError(400, f"structured output: {exc}", param="response_format") from exc
    # What the request leaves out comes from the model's generation_config.json, as vLLM does by default.
    defaults = state.sampling_defaults
    top_k = body.top_k if body.top_k is not None else int(defaults.get("top_k", 0))
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(defaults.get("temperature", 1.0)) if body.temperature is None else body.temperature,
            top_p=float(defaults.get("top_p", 1.0)) if body.top_p is None else body.top_p,
            top_k=0 if top_k == -1 else top_k,  # -1 means "off" in vLLM's API
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(stop_ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **controls,
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="logprobs" if "logprobs" in str(exc) else None) from exc


def _logits_controls(state: ServerState, body: schemas._Common) -> dict:
    """The request's penalties, bias, min_tokens and bad words as SamplingParams fields (values are checked there)."""
    controls: dict = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(body, name) is not None:
            controls[name] = getattr(body, name)
    if body.logit_bias:
        bias = []
        for key, value in body.logit_bias.items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < state.vocab_size:
                raise ApiError(400, f"logit_bias keys must be token ids in 0..{state.vocab_size - 1}, got {key!r}",
                               param="logit_bias")  # fmt: skip
            bias.append((int(key), value))
        controls["logit_bias"] = tuple(bias)
    if body.bad_words:
        if any(not word for word in body.bad_words):
            raise ApiError(400, "bad_words must be non-empty strings", param="bad_words")
        # As vLLM does: each word banned both at the start of a word (after a space) and glued to what precedes it.
        words = {tuple(state.text.encode(form, add_special_tokens=False))
                 for word in body.bad_words for form in (word, " " + word)}  # fmt: skip
        controls["bad_words_ids"] = tuple(sorted(w for w in words if w))
    return controls


def _stop_strings(body: schemas._Common) -> list[str]:
    stop = body.stop
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or any(not s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4 non-empty strings", param="stop")
    return stop


async def _off_loop(size: int, fn, *args):
    """Tokenize long texts in a worker thread (the Rust tokenizer releases the GIL), so the event loop keeps
    streaming other requests' tokens meanwhile; short ones inline (a thread hop costs more than they do)."""
    if size < _INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _prompt_ids(state: ServerState, prompt) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await _off_loop(len(prompt), state.text.encode, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < state.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{state.vocab_size - 1}", param="prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def _usage(delta: Delta) -> dict:
    return {
        "prompt_tokens": delta.num_prompt_tokens,
        "completion_tokens": delta.num_output_tokens,
        "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens,
    }


# ---- the OpenAI routes -----------------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.CompletionRequest)
    _check_model(state, body.model)
    prompt_ids = await _prompt_ids(state, body.prompt)
    sampling = _sampling(state, body, len(prompt_ids), 16 if body.max_tokens is None else body.max_tokens)
    echo = prompt_ids if body.echo else None
    return await _run(request, state, body, "cmpl", prompt_ids, sampling, arrival, chat=False, echo=echo)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.ChatCompletionRequest)
    _check_model(state, body.model)
    try:
        messages = schemas.chat_messages_as_dicts(body.messages)
        prompt_ids = await _off_loop(sum(len(m["content"]) for m in messages), state.text.encode_chat, messages)
    except (ValueError, TemplateError) as exc:  # e.g. a template that insists on alternating roles
        raise ApiError(400, f"cannot apply the chat template: {exc}" if isinstance(exc, TemplateError) else str(exc),
                       param="messages") from exc  # fmt: skip
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(state, body, len(prompt_ids), max_tokens)
    return await _run(request, state, body, "chatcmpl", prompt_ids, sampling, arrival, chat=True)


async def _run(
    request, state, body, prefix, prompt_ids, sampling, arrival, *, chat: bool, echo: list[int] | None = None
) -> web.StreamResponse:
    """`echo`: the prompt's ids, when the completion starts with the prompt (and its logprobs, if asked)."""
    stop = _stop_strings(body)
    priority = _priority(state, request, body.priority)
    timeout_s = _timeout(state, request, body.timeout)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    generation = Generation(
        state, request_id, prompt_ids, sampling, stop, priority=priority, timeout_s=timeout_s, arrival=arrival
    )
    want_timing = request.headers.get("x-overlap-timing") == "1"
    try:
        if body.stream:
            return await _stream(request, state, body, generation, request_id, chat, want_timing, echo)
        return await _collect(state, generation, request_id, chat, want_timing, echo)
    finally:
        generation.close()


def _echoed(state, delta: Delta, echo: list[int] | None) -> Delta:
    """The first delta with the prompt in front: its text, and its tokens with their logprobs (the first None)."""
    if echo is None:
        return delta
    delta.text = state.text.decode(echo) + delta.text
    if delta.prompt_logprobs is not None or delta.logprobs is not None:
        prompt_lps = delta.prompt_logprobs or [None] * len(echo)
        delta.token_ids = list(echo) + delta.token_ids
        delta.logprobs = list(prompt_lps) + (delta.logprobs or [None] * (len(delta.token_ids) - len(echo)))
    return delta


async def _collect(state, generation: Generation, request_id: str, chat: bool, want_timing: bool,
                   echo: list[int] | None = None) -> web.Response:  # fmt: skip
    parts: list[str] = []
    last = None
    token_ids, logprobs = [], []
    first = True
    async for delta in generation.deltas():
        if first:
            delta, first = _echoed(state, delta, echo), False
        parts.append(delta.text)
        token_ids += delta.token_ids
        logprobs += delta.logprobs or [None] * len(delta.token_ids)
        last = delta
    text = "".join(parts)
    lp = None
    if generation.wants_logprobs:
        lp = chat_logprobs(state.text, token_ids, logprobs) if chat else completion_logprobs(
            state.text, token_ids, logprobs, 0)  # fmt: skip
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp}
    else:
        choice = {"index": 0, "text": text, "logprobs": lp}
    choice["finish_reason"] = last.finish_reason
    data = {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": _usage(last),
    }
    if want_timing:
        data["overlap_timing"] = last.timing
    return json_response(data)


async def _stream(request, state, body, generation, request_id: str, chat: bool, want_timing: bool, echo=None):
    options = body.stream_options or schemas.StreamOptions()
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    text_offset = 0

    def chunk(text: str | None, finish_reason: str | None, delta: Delta | None, first: bool = False) -> bytes:
        nonlocal text_offset
        lp = None
        if delta is not None and generation.wants_logprobs:
            if chat:
                lp = chat_logprobs(state.text, delta.token_ids, delta.logprobs)
            else:
                lp = completion_logprobs(state.text, delta.token_ids, delta.logprobs, text_offset)
                text_offset += sum(len(t) for t in lp["tokens"])
        if chat:
            message = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": message, "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        data = {"id": request_id, "object": kind, "created": created, "model": state.model_name, "choices": [choice]}
        if options.include_usage:
            data["usage"] = _usage(delta) if options.continuous_usage_stats and delta is not None else None
        return b"data: " + _json.encode(data) + b"\n\n"

    # The first delta comes before the headers, so a request the engine refuses still gets its 4xx/5xx status.
    deltas = generation.deltas()
    last = _echoed(state, await anext(deltas), echo)
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    try:
        if chat:
            await response.write(chunk("", None, None, first=True))
        await response.write(chunk(last.text, last.finish_reason, last))
        async for delta in deltas:
            last = delta
            await response.write(chunk(delta.text, delta.finish_reason, delta))
    except ApiError as exc:  # the headers are sent already: report the error in the stream
        await response.write(b"data: " + _json.encode(exc.body()) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        await deltas.aclose()
    if options.include_usage:
        final = {"id": request_id, "object": kind, "created": created, "model": state.model_name, "choices": []}
        final["usage"] = _usage(last)
        if want_timing:
            final["overlap_timing"] = last.timing
        await response.write(b"data: " + _json.encode(final) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.client.connected or not state.model_name:
        # An empty list with 200 would tell a client's start-up probe that this server serves nothing.
        raise engine_unavailable("the engine is not connected yet, so no model is served; retry shortly")
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "overlap",
             "max_model_len": state.max_model_len}  # fmt: skip
    return json_response({"object": "list", "data": [model]})


# ---- vLLM's utility routes ---------------------------------------------------------------------------------------


def _check_optional_model(state: ServerState, model: str | None) -> None:
    if model is not None:
        _check_model(state, model)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.TokenizeRequest)
    _check_optional_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    try:
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await _off_loop(len(body.prompt), state.text.encode, body.prompt, special)
        else:
            messages = schemas.chat_messages_as_dicts(body.messages)
            ids = await _off_loop(sum(len(m["content"]) for m in messages), state.text.encode_chat, messages,
                                  body.add_generation_prompt, bool(body.add_special_tokens))  # fmt: skip
    except (ValueError, TemplateError) as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    strs = [state.text.token_text(t) for t in ids] if body.return_token_strs else None
    return json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.DetokenizeRequest)
    _check_optional_model(state, body.model)
    if any(not 0 <= t < state.vocab_size for t in body.tokens):
        raise ApiError(400, f"tokens must be in 0..{state.vocab_size - 1}", param="tokens")
    return json_response({"prompt": state.text.decode(body.tokens)})


async def version(request: web.Request) -> web.Response:
    from importlib.metadata import version as dist_version

    return json_response({"version": dist_version("overlap-sidecar")})


# ---- operations ------------------------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the sidecar process answers (the engine being away is a readiness matter)."""
    return json_response({"status": "ok"})


async def health(request: web.Request) -> web.Response:
    """Load generators probe this: 200 when requests can be served."""
    return await readyz(request)


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = {
        "ready": state.ready,
        "engine_connected": state.client.connected,
        "tokenizer_loaded": state.text is not None,
        "draining": state.draining,
    }
    return json_response(body, status=200 if state.ready else 503)


ROUTES = [
    ("POST", "/v1/completions", "Create a text completion (OpenAI-compatible; stream for SSE)", completions,
     schemas.CompletionRequest),
    ("POST", "/v1/chat/completions", "Create a chat completion (OpenAI-compatible; stream for SSE)",
     chat_completions, schemas.ChatCompletionRequest),
    ("GET", "/v1/models", "List the served model", list_models, None),
    ("POST", "/tokenize", "Token ids of a prompt or chat messages (vLLM's shape)", tokenize, schemas.TokenizeRequest),
    ("POST", "/detokenize", "Text of token ids (vLLM's shape)", detokenize, schemas.DetokenizeRequest),
    ("GET", "/version", "The server's version", version, None),
    ("GET", "/health", "200 when requests can be served (for load generators)", health, None),
    ("GET", "/healthz", "Liveness: the sidecar answers", healthz, None),
    ("GET", "/readyz", "Readiness: engine connected, tokenizer loaded, not draining", readyz, None),
]  # fmt: skip
