"""From an OpenAI request to what the engine takes: the model check, priority and timeout (body or header), the
prompt's token ids, the stop strings, and the SamplingParams (shared by completions and chat)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from overlap.engine.errors import InvalidRequestError
from overlap.engine.types import SamplingParams
from overlap.openai import schemas
from overlap.sidecar.http import read_body
from overlap.sidecar.state import STATE, ApiError, ServerState

_INLINE_TOKENIZE_CHARS = 16 * 1024
MAX_PROMPTS = 64  # prompts in one completions request
# A stop string is held back and searched for after every token, a bad word tokenized twice: both are bounded
MAX_STOP_CHARS = 1024
MAX_BAD_WORDS = 256
# Prompt logprobs (echo) a request may ask for, counted as prompt tokens x (logprobs + 1): each is ~15 bytes on the
# engine's wire, so one request's stay well inside a frame (protocol.MAX_FRAME_BYTES), which they get to themselves.
MAX_PROMPT_LOGPROBS = 1 << 20
# Request fields that reach SamplingParams under the same name when set (their values are checked there).
_PASSED_AS_IS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "seed")


async def accept(request: web.Request, schema: type):
    """A generation request's arrival time, the server's state (503 while draining) and its body, read against
    `schema` and checked to name the served model."""
    arrival = time.monotonic()
    state = request.app[STATE]
    state.check_accepting()
    body = await read_body(request, schema)
    check_model(state, body.model)
    return arrival, state, body


def check_model(state: ServerState, model: str | None) -> None:
    """`model` must name the served model or one of its LoRA adapters (None: not given, where the route allows)."""
    if model is not None and model != state.model_name and model not in state.lora_adapters:
        served = ", ".join(repr(name) for name in [state.model_name, *sorted(state.lora_adapters)])
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}",
                       code="model_not_found", param="model")  # fmt: skip


def lora_name(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a (checked) `model` names; None for the base model."""
    return model if model is not None and model != state.model_name else None


def _body_or_header(request: web.Request, value, header: str, convert, what: str, param: str):
    """The body's value, else the header's converted (a header that does not convert is the client's error)."""
    if value is not None or header not in request.headers:
        return value
    try:
        return convert(request.headers[header])
    except ValueError as exc:
        raise ApiError(400, f"the {header} header must be {what}", param=param) from exc


def priority(state: ServerState, request: web.Request, body_priority: int | None) -> int:
    value = _body_or_header(request, body_priority, "x-priority", int, "an integer", "priority")
    if value is None:
        return min(1, state.num_priority_levels - 1)
    if not 0 <= value < state.num_priority_levels:
        raise ApiError(
            400, f"priority must be in 0..{state.num_priority_levels - 1} (0 is the highest)", param="priority"
        )
    return value


def timeout(state: ServerState, request: web.Request, body_timeout: float | None) -> float:
    value = _body_or_header(request, body_timeout, "x-request-timeout", float, "a number of seconds", "timeout")
    if value is None:
        return state.config.request_timeout_s
    if not value > 0:
        raise ApiError(400, "timeout must be a positive number of seconds", param="timeout")
    return min(value, state.config.request_timeout_s)  # a request may only lower the server's timeout


def stop_strings(body: schemas._Common) -> list[str]:
    stop = body.stop
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop must be a string or a list of up to 4 strings of 1-{MAX_STOP_CHARS} characters",
                       param="stop")  # fmt: skip
    return stop


async def off_loop(size: int, fn, *args):
    """Tokenize long texts in a worker thread (the Rust tokenizer releases the GIL), so the event loop keeps
    streaming other requests' tokens meanwhile; short ones inline (a thread hop costs more than they do)."""
    if size < _INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def split_prompts(prompt) -> list:
    """Completions' `prompt`: a string, a list of token ids, or a list of several of either (a batch of prompts)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", param="prompt")
        return list(prompt)
    return [prompt]


async def prompt_ids(state: ServerState, prompt) -> list[int]:
    """One completion prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        ids = await off_loop(len(prompt), state.text.encode, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < state.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{state.vocab_size - 1}", param="prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def sampling_params(state: ServerState, body: schemas._Common, num_prompt: int, max_tokens: int | None,
                    echo: bool = False) -> SamplingParams:  # fmt: skip
    """The request's SamplingParams: `max_tokens` checked against the context (None: what is left of it), what the
    request leaves out from the model's generation_config.json (as vLLM does), and `echo` with logprobs scoring
    the prompt too (what evaluation harnesses read as log-likelihoods)."""
    unsupported = body.unsupported_fields()
    if unsupported:
        raise ApiError(400, f"not supported by this server: {', '.join(unsupported)}", param=unsupported[0])
    fields = {"max_tokens": _max_tokens(state, num_prompt, max_tokens)}
    stop_ids = body.stop_token_ids or []
    if any(not 0 <= t < state.vocab_size for t in stop_ids):
        raise ApiError(400, f"stop_token_ids must be in 0..{state.vocab_size - 1}", param="stop_token_ids")
    try:
        fields["logprobs"] = body.logprobs_wanted()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="top_logprobs") from exc
    fields["prompt_logprobs"] = fields["logprobs"] if echo else None
    if echo and fields["logprobs"] is not None and num_prompt * (fields["logprobs"] + 1) > MAX_PROMPT_LOGPROBS:
        raise ApiError(400, f"echo with logprobs={fields['logprobs']} over {num_prompt} prompt tokens asks for "
                       f"{num_prompt * (fields['logprobs'] + 1)} prompt logprobs, over this server's "
                       f"{MAX_PROMPT_LOGPROBS}: fewer logprobs or a shorter prompt", param="logprobs")  # fmt: skip
    fields.update(_logits_controls(state, body))
    try:
        fields["grammar"] = schemas.structured_output_grammar(body)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ApiError(400, f"structured output: {exc}", param="response_format") from exc
    defaults = state.sampling_defaults
    top_k = body.top_k if body.top_k is not None else int(defaults.get("top_k", 0))
    fields.update(
        temperature=float(defaults.get("temperature", 1.0)) if body.temperature is None else body.temperature,
        top_p=float(defaults.get("top_p", 1.0)) if body.top_p is None else body.top_p,
        top_k=0 if top_k == -1 else top_k,  # -1 means "off" in vLLM's API
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(stop_ids),
    )
    try:
        return SamplingParams(**fields)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param="logprobs" if "logprobs" in str(exc) else None) from exc


def _max_tokens(state: ServerState, num_prompt: int, max_tokens: int | None) -> int:
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
        return room
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if num_prompt + max_tokens > state.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
            "Please reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _logits_controls(state: ServerState, body: schemas._Common) -> dict:
    """The request's penalties, seed, bias, min_tokens and bad words as SamplingParams fields."""
    controls = {name: getattr(body, name) for name in _PASSED_AS_IS if getattr(body, name) is not None}
    if body.logit_bias:
        bias = []
        for key, value in body.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < state.vocab_size:
                raise ApiError(400, f"logit_bias keys must be token ids in 0..{state.vocab_size - 1}, got {key!r}",
                               param="logit_bias")  # fmt: skip
            bias.append((int(key), value))
        controls["logit_bias"] = tuple(bias)
    if body.bad_words:
        if len(body.bad_words) > MAX_BAD_WORDS or any(not w or len(w) > MAX_STOP_CHARS for w in body.bad_words):
            raise ApiError(400, f"bad_words must be up to {MAX_BAD_WORDS} strings of 1-{MAX_STOP_CHARS} characters",
                           param="bad_words")  # fmt: skip
        # As vLLM does: each word banned both at the start of a word (after a space) and glued to what precedes it.
        words = {tuple(state.text.encode(form, add_special_tokens=False))
                 for word in body.bad_words for form in (word, " " + word)}  # fmt: skip
        controls["bad_words_ids"] = tuple(sorted(w for w in words if w))
    return controls
