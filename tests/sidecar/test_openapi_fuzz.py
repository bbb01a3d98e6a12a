"""Property-based fuzzing of `overlap serve` from its own /openapi.json (schemathesis): whatever a client sends, valid
or not, no 5xx, and every answer matches the document (status, media type, body schema, the 405's Allow header).
The real engine and the tiny model answer, so the valid requests really generate."""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from tests.support.sidecar import http, metric_value, overlap_serve, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

# positive_data_acceptance is left out: some limits are not JSON Schema (prompt or messages, not both; token ids
# below the model's vocabulary; max_tokens within the context), so a schema-valid body can rightly get a 400.
LEFT_OUT = "some limits are not JSON Schema"
EXAMPLES = 50  # per route and mode
# The same cases every run (CI reproduces a failure as it is); OVERLAP_FUZZ_RANDOM=1 explores new ones.
RANDOM = os.environ.get("OVERLAP_FUZZ_RANDOM") == "1"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = json.dumps({"num_kv_blocks": 512, "max_num_seqs": 16, "num_threads": 1})
    with overlap_serve(tiny_model_dir, "engine.json", config) as s:
        yield s


def _operations(server):
    schema = schemathesis.openapi.from_url(f"{server['url']}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _served(case, model: str):
    """A generated request aimed at the served model (so valid ones reach the engine), with short generations."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = model
    if not isinstance(case.body, dict):
        return case
    if case.operation.path.startswith("/v1/") and not {"max_tokens", "max_completion_tokens"} & case.body.keys():
        case.body["max_tokens"] = 16  # the default, the rest of the context, takes the tiny model 40 s
    for key, most in (("max_tokens", 32), ("max_completion_tokens", 32), ("n", 4), ("best_of", 4)):
        if isinstance(case.body.get(key), int):
            case.body[key] = min(case.body[key], most)  # bounds are tested elsewhere; keep the run short
    return case


CALLS: list[int] = []


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_request_gets_a_5xx_or_an_answer_off_the_document(server, mode):
    for operation in _operations(server):
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # a route without a body has nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=not RANDOM)  # fmt: skip
        def fuzz(case):
            response = _served(case, server["model"]).call(timeout=60)
            CALLS.append(response.status_code)
            case.validate_response(response, excluded_checks=[schemathesis.checks.positive_data_acceptance])

        fuzz()


def test_a_method_a_route_does_not_take_gets_405_naming_the_ones_it_does(server):
    """RFC 9110: a 405 carries Allow (schemathesis' unsupported_method check); the error stays OpenAI's shape."""
    document = http("GET", f"{server['url']}/openapi.json")[2]
    for path, operations in document["paths"].items():
        method = "DELETE" if "post" in operations else "POST"
        status, headers, body = http(method, f"{server['url']}{path}", b"{}" if method == "POST" else None)
        assert status == 405 and body["error"]["type"] == "invalid_request_error", (path, status, body)
        assert "Allow" in headers, path
        assert {m.strip().lower() for m in headers["Allow"].split(",")} >= set(operations), (path, headers["Allow"])


def _engine_counts(server) -> tuple[float, float, float]:
    """(requests admitted, requests finished for any reason, requests running) from /metrics. Received counts
    every request that reached admission; those it refused never reached the engine."""
    text = http("GET", f"{server['url']}/metrics")[2]

    def total(name: str, reasons: tuple[str, ...]) -> float:
        return sum(metric_value(text, name, f'reason="{r}"') or 0 for r in reasons)

    refused = total("overlap_requests_rejected_total",
                    ("queued_requests", "queued_tokens", "inflight", "draining", "engine_unavailable"))  # fmt: skip
    finished = total("overlap_requests_finished_total", ("stop", "length", "abort", "timeout", "error"))
    admitted = metric_value(text, "overlap_requests_received_total") - refused
    return admitted, finished, metric_value(text, "vllm:num_requests_running")


def test_the_fuzzing_reached_the_engine_and_every_request_it_accepted_ended(server, reliability):
    """After the fuzzing (the test above, in file order): it generated, and every request the engine took ended."""
    assert CALLS, "run this file whole: the fuzzing test comes first"
    with contextlib.suppress(AssertionError):
        wait_until(lambda: (c := _engine_counts(server))[0] == c[1] and c[2] == 0, 30, "every request ended")
    received, finished, running = _engine_counts(server)
    assert received == finished and running == 0, (received, finished, running)
    by_class = Counter(f"{status // 100}xx" for status in CALLS)
    assert by_class["5xx"] == 0 and by_class["2xx"] > 0 and received > 0, by_class
    reliability.row(
        "Sidecar", "schemathesis fuzzing from /openapi.json, valid and invalid bodies, every route",
        load=f"{len(CALLS)} generated requests ({', '.join(f'{n} {k}' for k, n in sorted(by_class.items()))})",
        outcome="no 5xx; every answer's status, media type, body and headers match the document "
        f"(positive_data_acceptance left out: {LEFT_OUT}); the engine idle after",
        accepted=int(received), answered=int(finished), whole_module=True,
    )  # fmt: skip
