"""Sampling features through `overlap serve` and the official `openai` client: log-probabilities (completions
`logprobs: k`, chat `logprobs` / `top_logprobs`, streamed and not, equal to log_softmax of transformers' logits on the
tiny model) and the logits controls (penalties, logit_bias, min_tokens, bad_words; their exact semantics are
checked against transformers in tests/engine/test_logits_controls.py)."""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch

from tests.support.sidecar import http, overlap_serve

PROMPT_IDS = [1, 523, 1201, 77, 3000, 45, 812]
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = json.dumps({"num_kv_blocks": 256, "num_threads": 1})
    with overlap_serve(tiny_model_dir, "engine.json", config, "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """(greedy ids, log_softmax rows at each generated position) from transformers, for a prompt of token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def run(prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
        return ids[len(prompt) :], logits.float().log_softmax(-1)

    run.tokenizer = tokenizer
    return run


def _piece(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def test_completion_logprobs_equal_transformers_streamed_and_not(client, server, reference):
    tokens, ref = reference(PROMPT_IDS, 8)
    kwargs = dict(model=server["model"], prompt=PROMPT_IDS, max_tokens=8, temperature=0, logprobs=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    lp = client.completions.create(**kwargs).choices[0].logprobs
    assert lp.tokens == [_piece(reference.tokenizer, t) for t in tokens]
    for n, token in enumerate(tokens):
        assert lp.token_logprobs[n] == pytest.approx(float(ref[n, token]), abs=1e-4)
        values, ids = ref[n].topk(3)
        want = {_piece(reference.tokenizer, i): v for i, v in zip(ids.tolist(), values.tolist(), strict=True)}
        assert lp.top_logprobs[n].keys() == want.keys()
        assert list(lp.top_logprobs[n].values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**kwargs, stream=True):
        piece = chunk.choices[0].logprobs
        if piece is not None:
            for key in streamed:
                streamed[key] += getattr(piece, key)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_equal_transformers_streamed_and_not(client, server, reference):
    messages = [{"role": "user", "content": "Say something."}]
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = reference.tokenizer(prompt, add_special_tokens=False).input_ids
    tokens, ref = reference(prompt_ids, 6)
    kwargs = dict(model=server["model"], messages=messages, max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [c.token for c in content] == [_piece(reference.tokenizer, t) for t in tokens]
    for n, (item, token) in enumerate(zip(content, tokens, strict=True)):
        assert item.logprob == pytest.approx(float(ref[n, token]), abs=1e-4)
        assert item.bytes == list(item.token.encode())
        values, ids = ref[n].topk(2)
        assert [t.token for t in item.top_logprobs] == [_piece(reference.tokenizer, i) for i in ids.tolist()]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)

    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


def test_echo_with_logprobs_scores_the_prompt_streamed_and_not(client, server, reference, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT_IDS])).logits[0].float().log_softmax(-1)
    kwargs = dict(model=server["model"], prompt=PROMPT_IDS, max_tokens=2, temperature=0, logprobs=2, echo=True)
    choice = client.completions.create(**kwargs).choices[0]
    assert choice.text.startswith(reference.tokenizer.decode(PROMPT_IDS, skip_special_tokens=True))
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(PROMPT_IDS)] == [_piece(reference.tokenizer, t) for t in PROMPT_IDS]
    for p in range(1, len(PROMPT_IDS)):
        assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, PROMPT_IDS[p]]), abs=1e-4), p
        assert len(lp.top_logprobs[p]) == 2
    assert lp.tokens[len(PROMPT_IDS)] == _piece(reference.tokenizer, int(ref[-1].argmax()))
    streamed_tokens, streamed_values, text = [], [], ""
    for chunk in client.completions.create(**kwargs, stream=True):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_values += chunk.choices[0].logprobs.token_logprobs
    assert text == choice.text and streamed_tokens == lp.tokens
    assert streamed_values[0] is None and streamed_values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    plain = client.completions.create(model=server["model"], prompt="Hello there", max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[0].logprobs is None


def test_without_logprobs_the_field_is_null(client, server):
    out = client.completions.create(model=server["model"], prompt=PROMPT_IDS, max_tokens=3)
    assert out.choices[0].logprobs is None
    chat = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)  # fmt: skip
    assert chat.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs must be an integer in 0..20"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs must be an integer in 0..20"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in 0..20"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ],
)
def test_bad_logprobs_requests_get_a_400(server, path, body, message):
    status, _, data = http("POST", server["url"] + path, {"model": server["model"], **body})
    assert status == 400 and message in data["error"]["message"], data


def _tokens(client, server, **kwargs) -> tuple[list[str], str]:
    out = client.completions.create(model=server["model"], prompt=PROMPT_IDS, temperature=0, logprobs=0,
                                    **kwargs)  # fmt: skip
    return out.choices[0].logprobs.tokens, out


def test_logit_bias_min_tokens_and_bad_words_reach_the_sampler(client, server, reference):
    free, _ = _tokens(client, server, max_tokens=6, extra_body={"ignore_eos": True})
    favourite = 4242
    forced, _ = _tokens(client, server, max_tokens=6, logit_bias={str(favourite): 100},
                        extra_body={"ignore_eos": True})  # fmt: skip
    assert forced == [_piece(reference.tokenizer, favourite)] * 6 != free
    # EOS (id 2) pushed to the top, held back by min_tokens: 4 tokens, then EOS stops the request.
    _, out = _tokens(client, server, max_tokens=12, logit_bias={"2": 100}, extra_body={"min_tokens": 4})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 5
    word = reference.tokenizer.decode([favourite])
    banned, _ = _tokens(client, server, max_tokens=6, logit_bias={str(favourite): 100},
                        extra_body={"ignore_eos": True, "bad_words": [word.strip()]})  # fmt: skip
    assert _piece(reference.tokenizer, favourite) not in banned


def test_penalties_change_what_a_bias_would_repeat(client, server, reference):
    favourite = _piece(reference.tokenizer, 4242)
    plain = []
    for value in (4, 8, 12, 16, 24):  # the smallest bias that makes greedy repeat the token (random weights)
        bias = {"4242": value}
        plain, _ = _tokens(client, server, max_tokens=12, logit_bias=bias, extra_body={"ignore_eos": True})
        if plain.count(favourite) >= 3:
            break
    assert plain.count(favourite) >= 3
    extra = {"ignore_eos": True, "repetition_penalty": 1.5}
    penalized, _ = _tokens(client, server, max_tokens=12, logit_bias=bias, frequency_penalty=2.0,
                           presence_penalty=2.0, extra_body=extra)  # fmt: skip
    assert penalized.count(favourite) < plain.count(favourite)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # bounds the schema holds (and /openapi.json shows) are named by the decoder, with the field's path
        ({"presence_penalty": 3}, "Expected `float` <= 2.0 - at `$.presence_penalty`"),
        ({"frequency_penalty": -2.5}, "Expected `float` >= -2.0 - at `$.frequency_penalty`"),
        ({"repetition_penalty": 0}, "Expected `float` > 0.0 - at `$.repetition_penalty`"),
        ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 200}}, "logit_bias values must be in [-100, 100]"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens must be in 0..max_tokens (10)"),
        ({"bad_words": [""]}, "bad_words must be up to 256 strings of 1-1024 characters"),
    ],
)
def test_bad_logits_controls_get_a_400(server, body, message):
    status, _, data = http("POST", server["url"] + "/v1/completions", {"model": server["model"], "prompt": "x", **body})
    assert status == 400 and message in data["error"]["message"], data


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rank", "open"],
    "additionalProperties": False,
}


def test_json_schema_response_validates_for_50_seeds(client, server):
    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "a city"}]
    for seed in range(50):
        out = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=120, temperature=1.0,
                                             seed=seed, response_format=response_format,
                                             extra_body={"disable_any_whitespace": True})  # fmt: skip
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
        assert out.choices[0].finish_reason == "stop"


def test_json_object_guided_choice_and_regex_streamed_and_not(client, server):
    chat = dict(model=server["model"], messages=[{"role": "user", "content": "x"}], max_tokens=80, temperature=1.0)
    # Any JSON object is unbounded: a random model can stay inside one string for ever. A bias on the closing
    # characters lets the grammar close the object within the budget; what it emits must still parse.
    closers = {}
    for c in ('"', "}"):
        ids = http("POST", f"{server['url']}/tokenize", {"prompt": c, "add_special_tokens": False})[2]["tokens"]
        closers |= {str(t): 10 for t in ids}
    for seed in range(3):
        obj = client.chat.completions.create(**{**chat, "max_tokens": 400}, seed=seed, logit_bias=closers,
                                             response_format={"type": "json_object"},
                                             extra_body={"disable_any_whitespace": True})  # fmt: skip
        assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    stream = client.chat.completions.create(**chat, seed=2, stream=True,
                                            extra_body={"guided_choice": ["yes", "no", "maybe not"]})  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed in ("yes", "no", "maybe not")
    regex = client.completions.create(model=server["model"], prompt="id:", max_tokens=20, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": r"[A-Z]{2}/[0-9]{4}"})  # fmt: skip
    assert re.fullmatch(r"[A-Z]{2}/[0-9]{4}", regex.choices[0].text)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"guided_json": {"type": "objectx"}}, "invalid grammar"),
        ({"guided_json": "{not json"}, "structured output"),
        ({"guided_regex": "[a-", "guided_choice": ["a"]}, "at most one structured-output constraint"),
        ({"guided_choice": []}, "guided_choice must be a list of non-empty strings"),
        ({"guided_choice": ["x" * 70000]}, "at most 65536 are accepted"),
    ],
)
def test_bad_structured_output_requests_get_a_400(server, body, message):
    status, _, data = http("POST", server["url"] + "/v1/completions", {"model": server["model"], "prompt": "x", **body})
    assert status == 400 and message in data["error"]["message"], data


def test_bad_response_format_gets_a_400(server):
    body = {"model": server["model"], **CHAT, "response_format": {"type": "xml"}}
    status, _, data = http("POST", server["url"] + "/v1/chat/completions", body)
    assert status == 400 and "response_format type must be" in data["error"]["message"], data


def test_n_sequences_are_distinct_reproducible_and_streamed_alike(client, server):
    kwargs = dict(model=server["model"], prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, n=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1 and [c.text for c in client.completions.create(**kwargs).choices] == texts
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(
        http("POST", f"{server['url']}/tokenize", {"prompt": "Once upon a time"})[2]["tokens"])  # fmt: skip
    streamed = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts
    chat = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0, seed=1)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]


def test_a_list_of_prompts_gets_n_choices_each_in_order(client, server):
    prompts = ["The sky is", "My favourite food is"]
    batched = client.completions.create(model=server["model"], prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batched.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=server["model"], prompt=prompt, max_tokens=5, temperature=0)
        assert batched.choices[2 * p].text == batched.choices[2 * p + 1].text == alone.choices[0].text


def test_best_of_returns_the_sequence_with_the_highest_cumulative_logprob(client, server):
    kwargs = dict(model=server["model"], prompt="Hello", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    candidates = []
    for j in range(3):  # what best_of's sequences are: seeds 7, 8, 9
        choice = client.completions.create(**kwargs, seed=7 + j, logprobs=0).choices[0]
        candidates.append((sum(choice.logprobs.token_logprobs), choice.text))
    best = client.completions.create(**kwargs, seed=7, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].text == max(candidates)[1]
    assert best.choices[0].logprobs is None  # ranked on logprobs nobody asked to see
    assert best.usage.completion_tokens == 18  # every generated sequence counts


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}},
]  # fmt: skip


def test_tool_choice_required_always_yields_parseable_calls(client, server):
    import jsonschema

    schemas_by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(10):
        out = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "weather?"}],
                                             tools=TOOLS, tool_choice="required", max_tokens=150, temperature=1.0,
                                             seed=seed, parallel_tool_calls=False)  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas_by_name[call.function.name])


def test_named_tool_choice_streamed_and_a_tool_result_turn(client, server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "Oslo?"}],
                                            tools=TOOLS, tool_choice=named, max_tokens=60, temperature=1.0, seed=3,
                                            stream=True)  # fmt: skip
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"city"}
    history = [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp_c": 4}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(model=server["model"], messages=history, tools=TOOLS, max_tokens=5)
    assert answer.choices[0].finish_reason in ("stop", "length")  # auto with the hermes parser: plain text here


def test_tool_choice_errors_get_a_400(server):
    base = {"model": server["model"], **CHAT, "tools": TOOLS}
    for body, message in (({**base, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                           "not among the tools"),
                          ({**base, "tool_choice": "required", "response_format": {"type": "json_object"}},
                           "cannot be combined with response_format")):  # fmt: skip
        status, _, data = http("POST", server["url"] + "/v1/chat/completions", body)
        assert status == 400 and message in data["error"]["message"], data
