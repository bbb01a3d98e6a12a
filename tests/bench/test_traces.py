"""Traces: seeded generators are reproducible, transforms do what they say, bad files are refused clearly."""

from __future__ import annotations

import numpy as np
import pytest

from overlap.bench import trace_generators, traces
from overlap.bench.traces import Trace, TraceError, TraceRequest


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: trace_generators.poisson(20, 5, seed=seed),
        lambda seed: trace_generators.on_off_bursts(40, 2, 1.0, 2.0, 6, seed=seed),
        lambda seed: trace_generators.diurnal(1, 30, 4, 8, seed=seed),
    ],
    ids=["poisson", "bursts", "diurnal"],
)
def test_generators_are_identical_for_the_same_seed_and_differ_otherwise(make):
    a, b, c = make(7), make(7), make(8)
    assert len(a) > 10
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_poisson_rate_is_about_right():
    trace = trace_generators.poisson(50, 40, seed=1)
    assert 45 < len(trace) / 40 < 55
    assert all(0 <= r.arrival_s < 40 for r in trace.requests)


def test_bursts_concentrate_arrivals_in_the_on_periods():
    trace = trace_generators.on_off_bursts(rate_on=60, rate_off=0, on_s=1, off_s=3, duration_s=12, seed=3)
    # with rate_off = 0 every arrival lies in an on period [4k, 4k + 1)
    assert all(r.arrival_s % 4 < 1 for r in trace.requests)


def test_diurnal_ramp_peaks_in_the_middle_of_the_period():
    trace = trace_generators.diurnal(min_rate=1, max_rate=60, period_s=10, duration_s=10, seed=2)
    arrivals = np.array([r.arrival_s for r in trace.requests])
    middle = ((arrivals > 3.5) & (arrivals < 6.5)).sum()
    edges = ((arrivals < 1.5) | (arrivals > 8.5)).sum()
    assert middle > 4 * edges


def test_scale_rate_and_tokens_record_what_they_did():
    base = trace_generators.poisson(10, 10, seed=0)
    faster = traces.scale_rate(base, 2)
    assert [r.arrival_s for r in faster.requests] == pytest.approx([r.arrival_s / 2 for r in base.requests])
    smaller = traces.scale_tokens(faster, 0.5, max_output_tokens=10)
    assert [r.prompt_tokens for r in smaller.requests] == [max(1, round(r.prompt_tokens * 0.5)) for r in base.requests]
    assert all(r.max_tokens <= 10 for r in smaller.requests)
    assert smaller.transforms == ("rate x2", "tokens x0.5, output cap 10")
    assert "rate x2" in smaller.describe()


def test_inject_burst_doubles_the_rate_inside_the_window_only():
    base = trace_generators.poisson(20, 20, seed=4)
    burst = traces.inject_burst(base, at_s=5, length_s=5, factor=2, seed=1)

    def count(trace, lo, hi):
        return sum(lo <= r.arrival_s < hi for r in trace.requests)

    assert count(burst, 5, 10) == 2 * count(base, 5, 10)
    assert count(burst, 0, 5) == count(base, 0, 5)
    assert count(burst, 10, 20) == count(base, 10, 20)
    assert traces.inject_burst(base, 5, 5, 2, seed=1).requests == burst.requests


def test_truncate_keeps_the_start():
    base = trace_generators.poisson(20, 20, seed=4)
    cut = traces.truncate(base, duration_s=5)
    assert cut.requests == tuple(r for r in base.requests if r.arrival_s < 5)
    assert len(traces.truncate(base, max_requests=7)) == 7
    with pytest.raises(TraceError, match="leaves no requests"):
        traces.truncate(base, duration_s=1e-9)


def test_jsonl_and_csv_round_trip(tmp_path):
    trace = Trace(
        (
            TraceRequest(0.0, 8, prompt_tokens=12),
            TraceRequest(0.5, 4, prompt="Hello there", priority=0),
        ),
        "mini",
    )
    path = tmp_path / "mini.jsonl"
    trace.save_jsonl(path)
    assert traces.load_trace(path).requests == trace.requests
    csv_path = tmp_path / "mini.csv"
    csv_path.write_text("arrival_s,prompt,prompt_tokens,max_tokens,priority\n0,,12,8,\n0.5,Hello there,,4,0\n")
    assert traces.load_trace(csv_path).requests == trace.requests


@pytest.mark.parametrize(
    ("content", "line", "reason"),
    [
        (
            '{"arrival_s": 0, "prompt_tokens": 4, "max_tokens": 2}\n{"arrival_s": 1, "prompt_tokens": 4\n',
            2,
            "not valid JSON",
        ),
        (
            '{"arrival_s": 0, "prompt_tokens": 4, "max_tokens": 2}\n\n{"arrival_s": 1, "prompt_tokens": 4}\n',
            3,
            "missing field 'max_tokens'",
        ),
        ('{"arrival_s": -1, "prompt_tokens": 4, "max_tokens": 2}\n', 1, "arrival_s must be"),
        ('{"arrival_s": 0, "prompt_tokens": "many", "max_tokens": 2}\n', 1, "'prompt_tokens' must be an integer"),
        ('{"arrival_s": 0, "max_tokens": 2}\n', 1, "exactly one of 'prompt'"),
        ('{"arrival_s": 0, "prompt_tokens": 4, "max_tokens": 2, "colour": 1}\n', 1, "unknown field"),
        ("[1, 2]\n", 1, "expected a JSON object"),
    ],
)
def test_malformed_jsonl_is_refused_with_line_and_reason(tmp_path, content, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError) as info:
        traces.load_trace(path)
    assert f"bad.jsonl:{line}:" in str(info.value)
    assert reason in str(info.value)


def test_malformed_csv_is_refused_with_line_and_reason(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("arrival_s,prompt_tokens,max_tokens\n0,4,2\n0.5,4,zero\n")
    with pytest.raises(TraceError, match=r"bad\.csv:3: field 'max_tokens' must be an integer"):
        traces.load_trace(path)


def test_unknown_trace_name_is_refused():
    with pytest.raises(TraceError, match="neither a file nor a built-in trace"):
        traces.resolve_trace("no-such-trace")


def test_builtin_traces_load():
    for name in ("steady", "bursty", "bursty_2x", "diurnal"):
        trace = traces.resolve_trace(name)
        assert len(trace) > 50
        assert all(r.prompt_tokens for r in trace.requests)


def test_azure_trace_loads_and_scales():
    azure = traces.resolve_trace("azure")
    assert len(azure) == 19366
    assert azure.requests[0].arrival_s == 0
    assert 3500 < azure.duration_s < 3700  # one hour
    scaled = traces.TraceTransforms(start_s=0, duration_s=60, scale_rate=2, scale_tokens=0.1).apply(azure)
    assert scaled.duration_s < 30
    assert "rate x2" in scaled.describe() and "tokens x0.1" in scaled.describe()


def test_shipped_traces_match_their_recipes():
    for name, recipe in trace_generators.BUILTIN_RECIPES.items():
        shipped = traces.resolve_trace(name)
        assert shipped.requests == tuple(traces.TraceRequest(**r.to_dict()) for r in recipe().requests), (
            f"{name}.jsonl is stale: run python -m overlap.bench.trace_generators"
        )
    assert len(traces.resolve_trace("bursty_2x")) > len(traces.resolve_trace("bursty"))


def test_malformed_azure_row_is_refused_with_line_and_reason(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.99,many,109\n"
    )
    with pytest.raises(TraceError, match=r"azure\.csv:3: .*many"):
        traces.load_trace(path)


def test_a_trace_file_in_the_azure_format_is_named_by_its_file(tmp_path):
    lines = traces.AZURE_TRACE.read_text().splitlines()[:50]
    path = tmp_path / "our-bursts.csv"
    path.write_text("\n".join(lines) + "\n")
    assert traces.load_trace(path).name == "our-bursts"
    assert traces.load_trace(traces.AZURE_TRACE).name == "azure-conv"


def test_generated_bursts_are_seeded_and_ten_times_the_base_rate():
    from overlap.bench.trace_families import random_bursts, resolve

    one, same, other = (random_bursts(2.0, 10.0, 1800.0, seed=s) for s in (1, 1, 2))
    assert one == same and one != other
    arrivals = np.array([r.arrival_s for r in one.requests])
    per_5s = np.bincount((arrivals // 5).astype(int))
    # quiet stretches near the base rate (10 per 5 s), burst stretches near 10x it
    assert 5 <= np.median(per_5s) <= 16 and per_5s.max() >= 70
    assert resolve("bursts:3").name == "bursts-x10-seed3"
    with pytest.raises(TraceError, match="whole number"):
        resolve("bursts:many")
