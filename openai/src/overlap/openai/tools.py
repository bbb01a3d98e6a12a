"""Tool calls: the request's `tools` go to the model through its chat template, and what it writes comes back as
OpenAI `tool_calls`.

`tool_choice`:
  none       the tools are not shown to the model; plain text comes back
  auto       the model decides; its text is parsed by the `--tool-call-parser` (hermes: `<tool_call>{...}</tool_call>`
             blocks, as Qwen and Hermes models write them; llama3_json: a JSON object `{"name", "parameters"}`, or
             several separated by `;`, optionally after `<|python_tag|>`, as Llama 3.1+ writes them)
  required   at least one call, enforced by a JSON-schema grammar: `[{"name": ..., "parameters": {...}}, ...]`
  {"type": "function", "function": {"name": N}}
             a call of N, its arguments enforced by N's parameters schema
With the grammar (required, named) the output always parses, whatever the model; with auto it is what the parser
finds. Streaming sends the text first and each call whole in one delta, in OpenAI's chunk shape.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(slots=True)
class ToolSetup:
    """What a chat request's tools mean for this generation."""

    tools_for_template: list[dict] | None  # None: the template does not see them
    grammar_schema: dict | None  # a JSON schema the output must follow (required / named)
    named: str | None  # the one function a named tool_choice calls
    parser: str | None  # how to read the output (auto)

    @property
    def active(self) -> bool:
        return self.grammar_schema is not None or self.parser is not None


def setup(tools: list[dict] | None, tool_choice, parser: str | None, parallel: bool | None = None) -> ToolSetup | None:
    """Validate `tools` and `tool_choice`; ValueError with the reason when they are wrong. `parallel` False: one
    call at most (OpenAI's parallel_tool_calls)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function" or \
                not isinstance(function.get("name"), str) or not function["name"]:  # fmt: skip
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}"
            )
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        functions[function["name"]] = parameters
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolSetup(None, None, None, None)
    if choice == "auto":
        if parser is None:
            raise ValueError("tool_choice 'auto' needs the server's --tool-call-parser (hermes or llama3_json); "
                             "'required' or a named function work without one")  # fmt: skip
        return ToolSetup(tools, None, None, parser)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls} if len(calls) > 1 else calls[0]}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolSetup(tools, schema, None, None)
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})")
        return ToolSetup(tools, functions[name], name, None)
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def extract(setup: ToolSetup, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from the model's whole output."""
    if setup.named is not None:
        return None, [_call(setup.named, text)]
    if setup.grammar_schema is not None:  # required: the grammar wrote a JSON array of calls
        return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
    if setup.parser == "hermes":
        calls = []
        for block in _HERMES.findall(text):
            try:
                call = json.loads(block)
                calls.append(_call(call["name"], call.get("arguments", {})))
            except (ValueError, KeyError, TypeError):
                return text, []  # not a well-formed call: the text stands as it is
        content = text.split("<tool_call>", 1)[0].strip() if calls else text
        return content or None, calls
    if setup.parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        try:
            objects = [json.loads(part) for part in body.split(";") if part.strip()]
            calls = [_call(o["name"], o.get("parameters", o.get("arguments", {}))) for o in objects]
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        return None, calls
    return text, []


def message_for_template(message: dict) -> dict:
    """An assistant message's tool_calls as chat templates expect them (arguments as objects, as vLLM passes them)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("function", {}), dict):
            raise ValueError("each tool_calls entry must be {'type': 'function', 'function': {'name', 'arguments'}}")
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"tool_calls arguments must be JSON nested at most ~1000 deep: {exc}") from exc
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}
