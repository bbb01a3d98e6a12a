"""OpenAI request bodies as msgspec Structs: decoding validates types and names the field that is wrong.

Unknown fields are refused (a misspelt `max_token` must not be silently ignored). Fields of the OpenAI API that
this server does not implement are accepted only at their neutral value, and refused with a clear message
otherwise (`unsupported_fields`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from overlap.openai import tools

# Bounds in the types are in /openapi.json too; the rules a schema cannot say are checked where they apply.
_Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
_Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # what the engine's wire format carries


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: _Int64 | None = None
    seed: _Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool | None = False  # OpenAI marks these nullable: null is the default (`__post_init__`)
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] | None = 1
    user: str | None = None
    # Overlap extensions: priority level (0 highest) and a timeout in seconds (may only lower the server's).
    priority: int | None = None
    timeout: float | None = None
    # Logits controls: OpenAI's, and vLLM's extras (repetition_penalty, min_tokens, bad_words).
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=10)] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    bad_words: list[str] | None = None
    # Structured outputs, vLLM's extras on both endpoints (chat also takes OpenAI's response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark (or GBNF) grammar text
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        self.stream = bool(self.stream)
        self.n = 1 if self.n is None else self.n

    def unsupported_fields(self) -> list[str]:
        """OpenAI fields accepted by the schema but not implemented: refused with a clear message when set."""
        return []


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a one-element list of either
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.echo = bool(self.echo)

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        return bad

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in 0..20, got {self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None


def structured_output_grammar(body: _Common) -> str | None:
    """The request's structured-output constraint as an llguidance grammar string (None when it has none).
    Raises ValueError for a malformed request; whether llguidance accepts the grammar is decided in the engine."""
    kinds = {name: getattr(body, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
    response_format = getattr(body, "response_format", None) or {}
    kind = response_format.get("type", "text")
    if kind == "json_object":
        kinds["response_format"] = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        kinds["response_format"] = spec.get("schema", {})
    elif kind != "text":
        raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")
    given = {k: v for k, v in kinds.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"give at most one structured-output constraint, got {', '.join(sorted(given))}")
    if not given:
        return None
    grammar = _grammar(body, *next(iter(given.items())))
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the constraint is {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
    return grammar


MAX_GRAMMAR_CHARS = 64 * 1024  # a schema or grammar larger than this is refused (the engine compiles it per request)


def _grammar(body: _Common, name: str, value) -> str:
    """One constraint (a guided_* field or response_format) in llguidance's grammar format."""
    import json

    if name in ("guided_json", "response_format"):
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except RecursionError:
            raise ValueError("the JSON schema is nested too deep") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        schema = {**schema, "x-guidance": {"whitespace_flexible": not body.disable_any_whitespace}}
        return json.dumps({"grammars": [{"json_schema": schema}]})
    if name == "guided_regex":
        return json.dumps({"grammars": [{"lark_grammar": "start: /" + value.replace("/", "\\/") + "/"}]})
    if name == "guided_choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("guided_choice must be a list of non-empty strings")
        return json.dumps({"grammars": [{"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in value)}]})
    return json.dumps({"grammars": [{"lark_grammar": value}]})


class LoadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /v1/load_lora_adapter: a PEFT folder the engine can read, served as model `lora_name`; with
    `load_inplace`, a name already loaded moves to the new folder (else it is refused)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name alone identifies an adapter here


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[Annotated[int, msgspec.Meta(ge=0)]]  # the upper bound is the model's vocabulary, checked later


def chat_messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages for the chat template, with content as plain text. Raises ValueError on bad messages."""
    if not messages:
        raise ValueError("messages must not be empty")
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"messages[{i}].content[{j}]: only parts of type 'text' with a 'text' are supported"
                    )
                texts.append(part.text)
            content = "".join(texts)
        item = {"role": message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        result.append(tools.message_for_template(item))
    return result
