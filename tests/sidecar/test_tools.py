"""Tool-call parsing and tool_choice validation, without processes (the end-to-end runs with the openai client are in
test_serve_sampling.py)."""

from __future__ import annotations

import json

import pytest

from overlap.openai import tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_blocks_become_calls_and_the_text_before_them_content():
    setup = tools.setup([WEATHER, TIME], "auto", "hermes")
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')  # fmt: skip
    content, calls = tools.extract(setup, text)
    assert content == "Let me check." and _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert tools.extract(setup, "no calls here") == ("no calls here", [])
    assert tools.extract(setup, "<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_llama3_json_calls_with_and_without_python_tag():
    setup = tools.setup([WEATHER, TIME], "auto", "llama3_json")
    content, calls = tools.extract(setup, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                          '{"name": "get_time", "parameters": {}}')  # fmt: skip
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert tools.extract(setup, "Sunny, I think.") == ("Sunny, I think.", [])


def test_required_and_named_read_what_their_grammar_wrote():
    required = tools.setup([WEATHER, TIME], "required", None)
    assert required.grammar_schema["type"] == "array" and len(required.grammar_schema["items"]["anyOf"]) == 2
    _, calls = tools.extract(required, '[{"name":"get_time","parameters":{}}]')
    assert _calls(calls) == [("get_time", {})]
    named = tools.setup([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.grammar_schema == WEATHER["function"]["parameters"]
    _, calls = tools.extract(named, '{"city":"Lima"}')
    assert _calls(calls) == [("get_weather", {"city": "Lima"})]
    none = tools.setup([WEATHER], "none", None)
    assert none.tools_for_template is None and not none.active


@pytest.mark.parametrize(
    ("tool_list", "choice", "parser", "message"),
    [
        ([WEATHER], "auto", None, "needs the server's --tool-call-parser"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "not among the tools"),
        ([{"type": "function", "function": {}}], "required", None, "tools\\[0\\] must be"),
        ([WEATHER], "sometimes", None, "tool_choice must be"),
        (None, "required", None, "tool_choice needs tools"),
    ],
)
def test_bad_tools_and_tool_choice_are_refused(tool_list, choice, parser, message):
    with pytest.raises(ValueError, match=message):
        tools.setup(tool_list, choice, parser)


def test_assistant_tool_calls_reach_templates_with_object_arguments():
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]}  # fmt: skip
    assert tools.message_for_template(message)["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}


def test_parallel_tool_calls_false_allows_one_call():
    assert tools.setup([WEATHER], "required", None, parallel=False).grammar_schema["maxItems"] == 1
    assert "maxItems" not in tools.setup([WEATHER], "required", None).grammar_schema
