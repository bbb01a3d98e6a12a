"""HTTP handlers of the public port: the OpenAI API, health, metrics and the OpenAPI document."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import web
from jinja2 import TemplateError

from overlap.engine.errors import InvalidRequestError
from overlap.engine.types import SamplingParams
from overlap.sidecar import schemas, tools
from overlap.sidecar.generation import Delta, Generation
from overlap.sidecar.logprobs import chat_logprobs, completion_logprobs
from overlap.sidecar.state import STATE, ApiError, ServerState, engine_unavailable
from overlap.sidecar.tools import ToolSetup
from overlap.sidecar.tools import extract as extract_tool_calls

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_json = msgspec.json.Encoder()
_INLINE_TOKENIZE_CHARS = 16 * 1024
MAX_PROMPTS = 64  # prompts in one completions request


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json", headers=headers)


async def read_body(request: web.Request, kind: type):
    """Decode and type-check a JSON body; every failure is a 400 naming what is wrong (408 for a body that does not
    arrive in time, 413 for one too big)."""
    timeout_s = request.app[STATE].config.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            body = await request.read()  # over client_max_size: 413 from aiohttp, rendered by the error middleware
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout") from None
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


def _split_prompts(prompt) -> list:
    """Completions' `prompt`: a string, a list of token ids, or a list of several of either (a batch of prompts)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
        return list(prompt)
    return [prompt]


async def _prompt_ids(state: ServerState, prompt) -> list[int]:
    """One completion prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        ids = await _off_loop(len(prompt), state.text.encode, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < state.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{state.vocab_size - 1}", param="prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")
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
    prompts = []
    for prompt in _split_prompts(body.prompt):
        ids = await _prompt_ids(state, prompt)
        prompts.append((ids, _sampling(state, body, len(ids), 16 if body.max_tokens is None else body.max_tokens)))
    return await _run(request, state, body, "cmpl", prompts, arrival, chat=False, echo=body.echo)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schemas.ChatCompletionRequest)
    _check_model(state, body.model)
    try:
        tool_setup = tools.setup(body.tools, body.tool_choice, state.config.tool_call_parser, body.parallel_tool_calls)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tool_choice" if body.tools else "tools") from exc
    try:
        messages = schemas.chat_messages_as_dicts(body.messages)
        shown = tool_setup.tools_for_template if tool_setup is not None else None
        prompt_ids = await _off_loop(sum(len(m["content"]) for m in messages), state.text.encode_chat, messages,
                                     True, False, shown)  # fmt: skip
    except (ValueError, TemplateError) as exc:  # e.g. a template that insists on alternating roles
        raise ApiError(400, f"cannot apply the chat template: {exc}" if isinstance(exc, TemplateError) else str(exc),
                       param="messages") from exc  # fmt: skip
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = _sampling(state, body, len(prompt_ids), max_tokens)
    if tool_setup is not None and tool_setup.grammar_schema is not None:  # required / named: the grammar decides
        if sampling.grammar is not None:
            raise ApiError(400, "tool_choice 'required' or a named function cannot be combined with response_format",
                           param="tool_choice")  # fmt: skip
        schema = {**tool_setup.grammar_schema, "x-guidance": {"whitespace_flexible": False}}
        sampling = dataclasses.replace(sampling, grammar=json.dumps({"grammars": [{"json_schema": schema}]}))
    active = tool_setup if tool_setup is not None and tool_setup.active else None
    return await _run(request, state, body, "chatcmpl", [(prompt_ids, sampling)], arrival, chat=True, tool_setup=active)


@dataclass(slots=True)
class _Sequence:
    """One of a request's sequences: of prompt `prompt_index`, choice `index` (streamed as is; best_of renumbers)."""

    index: int
    prompt_index: int
    generation: Generation
    echo: list[int] | None  # the prompt's ids when the completion echoes it
    first: bool  # the prompt's first sequence (usage counts each prompt once)


async def _run(
    request, state, body, prefix, prompts: list[tuple[list[int], SamplingParams]], arrival, *, chat: bool,
    echo: bool = False, tool_setup: ToolSetup | None = None,
) -> web.StreamResponse:  # fmt: skip
    """Every prompt's `n` sequences (`best_of` of them generated, the best `n` by cumulative logprob returned); the
    sequences of one prompt share its computed KV blocks in the engine. `echo`: completions start with the prompt."""
    stop = _stop_strings(body)
    priority = _priority(state, request, body.priority)
    timeout_s = _timeout(state, request, body.timeout)
    n, best_of = body.n, getattr(body, "best_of", None) or body.n
    cap = state.config.max_n
    if not 1 <= n <= cap:
        raise ApiError(400, f"n must be in 1..{cap} (the server's --max-n)", param="n")
    if not n <= best_of <= cap:
        raise ApiError(400, f"best_of must be in n..{cap}, got {best_of}", param="best_of")
    if best_of > n and body.stream:
        raise ApiError(400, "best_of > n cannot be streamed (the best ones are known only at the end)", param="best_of")
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    sequences: list[_Sequence] = []
    try:
        for p, (ids, sampling) in enumerate(prompts):
            first_id = None
            for j in range(best_of):
                seq_sampling = sampling
                if sampling.seed is not None and j:
                    seq_sampling = dataclasses.replace(seq_sampling, seed=sampling.seed + j)  # distinct, reproducible
                if best_of > n and sampling.logprobs is None:
                    seq_sampling = dataclasses.replace(seq_sampling, logprobs=0)  # ranking needs each token's
                seq_id = request_id if len(prompts) == 1 and best_of == 1 else f"{request_id}-{p}-{j}"
                generation = Generation(state, seq_id, ids, seq_sampling, stop, priority=priority, timeout_s=timeout_s,
                                        arrival=arrival, share_prompt_with=first_id)  # fmt: skip
                first_id = first_id or seq_id
                sequences.append(_Sequence(p * best_of + j, p, generation, ids if echo else None, j == 0))
        show_logprobs = prompts[0][1].logprobs is not None
        want_timing = request.headers.get("x-overlap-timing") == "1"
        if body.stream:
            return await _stream(
                request, state, body, sequences, request_id, chat, want_timing, show_logprobs, tool_setup
            )
        return await _collect(state, sequences, request_id, chat, want_timing, show_logprobs, n, best_of, tool_setup)
    finally:
        for sequence in sequences:  # a refusal half-way aborts the siblings already submitted
            sequence.generation.close()


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


@dataclass(slots=True)
class _Collected:
    sequence: _Sequence
    text: str
    token_ids: list[int]
    logprobs: list
    last: Delta
    num_echoed: int

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp[0] for lp in self.logprobs[self.num_echoed :] if lp is not None)


async def _collect_one(state, sequence: _Sequence) -> _Collected:
    parts: list[str] = []
    token_ids, logprobs, last, first = [], [], None, True
    async for delta in sequence.generation.deltas():
        if first:
            delta, first = _echoed(state, delta, sequence.echo), False
        parts.append(delta.text)
        token_ids += delta.token_ids
        logprobs += delta.logprobs or [None] * len(delta.token_ids)
        last = delta
    echoed = len(sequence.echo) if sequence.echo is not None and token_ids else 0
    return _Collected(sequence, "".join(parts), token_ids, logprobs, last, echoed)


async def _collect(state, sequences: list[_Sequence], request_id: str, chat: bool, want_timing: bool,
                   show_logprobs: bool, n: int, best_of: int,
                   tool_setup: ToolSetup | None = None) -> web.Response:  # fmt: skip
    results = await asyncio.gather(*(_collect_one(state, s) for s in sequences))
    if best_of > n:  # per prompt, the n best by cumulative logprob of what they generated
        kept = []
        for p in sorted({r.sequence.prompt_index for r in results}):
            ranked = sorted((r for r in results if r.sequence.prompt_index == p), key=lambda r: -r.cumulative_logprob)
            kept += ranked[:n]
    else:
        kept = list(results)
    choices = []
    for i, r in enumerate(kept):
        lp = None
        if show_logprobs:
            lp = chat_logprobs(state.text, r.token_ids, r.logprobs) if chat else completion_logprobs(
                state.text, r.token_ids, r.logprobs, 0)  # fmt: skip
        finish_reason = r.last.finish_reason
        if chat:
            message = {"role": "assistant", "content": r.text}
            if tool_setup is not None:
                message["content"], calls = _tool_calls(tool_setup, r.text)
                if calls:
                    message["tool_calls"], finish_reason = calls, "tool_calls"
            choice = {"index": i, "message": message, "logprobs": lp}
        else:
            choice = {"index": i, "text": r.text, "logprobs": lp}
        choice["finish_reason"] = finish_reason
        choices.append(choice)
    prompt_tokens = sum(r.last.num_prompt_tokens for r in results if r.sequence.first)
    completion_tokens = sum(r.last.num_output_tokens for r in results)  # all generated, best_of included
    data = {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if want_timing:
        data["overlap_timing"] = results[0].last.timing
    return json_response(data)


def _tool_calls(tool_setup: ToolSetup, text: str) -> tuple[str | None, list[dict]]:
    """(content, calls); output a grammar could not finish (max_tokens came first) stays text, with no call."""
    try:
        return extract_tool_calls(tool_setup, text)
    except (ValueError, KeyError, TypeError):
        return text, []


async def _stream(request, state, body, sequences: list[_Sequence], request_id: str, chat: bool, want_timing: bool,
                  show_logprobs: bool, tool_setup: ToolSetup | None = None):  # fmt: skip
    options = body.stream_options or schemas.StreamOptions()
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    text_offsets = dict.fromkeys(range(len(sequences)), 0)

    def chunk(seq: _Sequence, text: str | None, finish_reason: str | None, delta: Delta | None, first=False) -> bytes:
        lp = None
        if delta is not None and show_logprobs:
            if chat:
                lp = chat_logprobs(state.text, delta.token_ids, delta.logprobs)
            else:
                lp = completion_logprobs(state.text, delta.token_ids, delta.logprobs, text_offsets[seq.index])
                text_offsets[seq.index] += sum(len(t) for t in lp["tokens"])
        if chat:
            message = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": seq.index, "delta": message, "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": seq.index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        data = {"id": request_id, "object": kind, "created": created, "model": state.model_name, "choices": [choice]}
        if options.include_usage:
            data["usage"] = _usage(delta) if options.continuous_usage_stats and delta is not None else None
        return b"data: " + _json.encode(data) + b"\n\n"

    async def events(seq: _Sequence):
        """(seq, delta, None) per delta, then (seq, None, None) at its end, or (seq, None, error) on a failure."""
        first = True
        try:
            async for delta in seq.generation.deltas():
                if first:
                    delta, first = _echoed(state, delta, seq.echo), False
                yield seq, delta, None
        except ApiError as exc:
            yield seq, None, exc
            return
        yield seq, None, None

    # One sequence (the usual request) is read in place. Several are pumped into one queue in arrival order: a task
    # and a queue hand-off per streamed token, which a single sequence does not need.
    pumps: list[asyncio.Task] = []
    if len(sequences) == 1:
        source = events(sequences[0])
        next_event = source.__anext__
    else:
        source, queue = None, asyncio.Queue()

        async def pump(seq: _Sequence) -> None:
            async for event in events(seq):
                await queue.put(event)

        pumps = [asyncio.create_task(pump(seq)) for seq in sequences]
        next_event = queue.get

    def tool_chunks(seq: _Sequence, text: str, delta: Delta) -> list[bytes]:
        """A finished sequence under tools: its text, then each call whole, in OpenAI's delta shape."""
        content, calls = _tool_calls(tool_setup, text)
        out = [chunk(seq, content, None, None)] if content else []
        if calls:
            call_deltas = [{"index": k, **call} for k, call in enumerate(calls)]
            data = {"id": request_id, "object": kind, "created": created, "model": state.model_name,
                    "choices": [{"index": seq.index, "delta": {"tool_calls": call_deltas}, "logprobs": None,
                                 "finish_reason": None}]}  # fmt: skip
            out.append(b"data: " + _json.encode(data) + b"\n\n")
        out.append(chunk(seq, None, "tool_calls" if calls else delta.finish_reason, delta))
        return out

    buffered: dict[int, str] = {}  # under tools: each sequence's text until it ends
    lasts: dict[int, Delta] = {}
    remaining = len(sequences)
    try:
        # The first delta comes before the headers, so a request the engine refuses still gets its 4xx/5xx status.
        seq, delta, error = await next_event()
        if error is not None:
            raise error
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        try:
            if chat:
                for s in sequences:
                    await response.write(chunk(s, "", None, None, first=True))
            while True:
                if delta is None and error is None:
                    remaining -= 1
                    if remaining == 0:
                        break
                elif error is not None:
                    raise error
                elif tool_setup is not None:
                    lasts[seq.index] = delta
                    buffered[seq.index] = buffered.get(seq.index, "") + delta.text
                    if delta.finish_reason is not None:
                        for data in tool_chunks(seq, buffered[seq.index], delta):
                            await response.write(data)
                else:
                    lasts[seq.index] = delta
                    await response.write(chunk(seq, delta.text, delta.finish_reason, delta))
                seq, delta, error = await next_event()
        except ApiError as exc:  # the headers are sent already: report the error in the stream
            await response.write(b"data: " + _json.encode(exc.body()) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
    finally:
        if source is not None:
            await source.aclose()  # a client gone mid-stream: the generation's own cleanup aborts it in the engine
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    if options.include_usage:
        final = {"id": request_id, "object": kind, "created": created, "model": state.model_name, "choices": []}
        prompt_tokens = sum(lasts[s.index].num_prompt_tokens for s in sequences if s.first and s.index in lasts)
        completion_tokens = sum(d.num_output_tokens for d in lasts.values())
        final["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
        if want_timing:
            final["overlap_timing"] = next(iter(lasts.values())).timing
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
