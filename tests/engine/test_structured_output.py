"""Structured outputs in the engine (llguidance): the tiny model's weights are random, so only the grammar can make
its output parse. JSON schemas, regexes and choices, sampled at temperature 1 over many seeds, batched with plain
requests and through the overlapped pipeline."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.errors import InvalidRequestError
from overlap.engine.types import FinishReason, RequestSpec, SamplingParams
from tests.support.engine import add_and_run, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "tags"],
    "additionalProperties": False,
}


def json_grammar(schema: dict) -> str:
    return json.dumps({"grammars": [{"json_schema": {**schema, "x-guidance": {"whitespace_flexible": False}}}]})


def lark_grammar(text: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": text}]})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-buffer", "2-buffers"])
def engine(tiny_model_dir, two_torch_threads, request):
    return Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=512, num_kv_blocks=512, max_num_seqs=64,
                               num_buffers=request.param))  # fmt: skip


def test_json_schema_output_validates_for_50_seeds_batched_with_plain_requests(engine, tokenizer):
    grammar = json_grammar(SCHEMA)
    requests = {
        f"j{seed}": (
            [1, 40 + seed, 50, 60],
            SamplingParams(max_tokens=150, temperature=1.0, seed=seed, grammar=grammar),
        )
        for seed in range(50)
    }
    requests |= {f"p{i}": ([1, 70 + i], SamplingParams(max_tokens=20, temperature=1.0, seed=i)) for i in range(8)}
    outputs = add_and_run(engine, requests)
    for rid, outs in outputs.items():
        if rid.startswith("p"):
            continue
        text = tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)  # parses, and matches the schema
        assert outs[-1].finish_reason == FinishReason.STOP, (rid, text)  # EOS once the object is complete


def test_regex_and_choice(engine, tokenizer):
    regex = lark_grammar(r"start: /[0-9]{3}-[a-z]{2,4}/")
    choice = lark_grammar('start: "alpha" | "beta" | "gamma delta"')
    requests = {}
    for s in range(10):
        requests[f"r{s}"] = ([1, 5, 6], SamplingParams(max_tokens=30, temperature=1.0, seed=s, grammar=regex))
        requests[f"c{s}"] = ([1, 5, 7], SamplingParams(max_tokens=30, temperature=1.0, seed=s, grammar=choice))
    outputs = add_and_run(engine, requests)
    for rid, outs in outputs.items():
        text = tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
        if rid.startswith("r"):
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        else:
            assert text in ("alpha", "beta", "gamma delta"), text


def test_a_grammar_llguidance_rejects_is_refused_with_its_message(engine):
    with pytest.raises(InvalidRequestError, match=r"invalid grammar: .*objectx"):
        engine.add_request(RequestSpec("bad", [1, 2], SamplingParams(grammar=json_grammar({"type": "objectx"}))))
    engine.add_request(RequestSpec("bad", [1, 2], SamplingParams(max_tokens=2)))  # the id was not kept by the refusal
    add_and_run(engine, {})


def test_grammar_survives_preemption(tiny_model_dir, tokenizer):
    """A preempted request is recomputed; its matcher rolls back the dropped step's token."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=512, num_kv_blocks=512, num_buffers=2))
    grammar = json_grammar(SCHEMA)
    engine.add_request(
        RequestSpec("g", [1, 9, 9], SamplingParams(max_tokens=150, temperature=1.0, seed=3, grammar=grammar))
    )
    outs = []
    for step in range(400):
        outs += [o for o in engine.step() if o.request_id == "g"]
        if step in (5, 12):
            assert engine.scheduler.preempt("g", 0.0)
        if outs and outs[-1].finished:
            break
    text = tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
