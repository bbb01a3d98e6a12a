"""Traces made by rule, each from its seed: Poisson arrivals, on/off bursts, a diurnal wave, the shipped Azure hour's
token mix on another arrival process; and the builtin traces (steady, bursty, bursty_2x, diurnal), written to
traces/ by `python -m overlap.bench.trace_generators`."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np

from overlap.bench.traces import (
    AZURE_TRACE,
    DEFAULT_PRIORITY,
    TRACES_DIR,
    Trace,
    TraceError,
    TraceRequest,
    check_positive,
    inject_burst,
    load_azure,
    load_trace,
)


def _make_requests(arrivals, rng: np.random.Generator, prompt_tokens, max_tokens, priorities) -> list[TraceRequest]:
    """Draw token counts uniformly from the (low, high) ranges and a priority from `priorities` per arrival."""
    n = len(arrivals)
    prompts = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=n)
    outputs = rng.integers(max_tokens[0], max_tokens[1] + 1, size=n)
    prios = rng.choice(np.asarray(priorities), size=n)
    return [
        TraceRequest(arrival_s=float(t), prompt_tokens=int(p), max_tokens=int(o), priority=int(q))
        for t, p, o, q in zip(arrivals, prompts, outputs, prios, strict=True)
    ]


def poisson_arrivals(rng: np.random.Generator, rate: float, start: float, end: float) -> list[float]:
    times, t = [], start
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= end:
            return times
        times.append(t)


def poisson(
    rate: float,
    duration_s: float,
    seed: int = 0,
    prompt_tokens: tuple[int, int] = (16, 64),
    max_tokens: tuple[int, int] = (16, 32),
    priorities: tuple[int, ...] = (DEFAULT_PRIORITY,),
) -> Trace:
    """Poisson arrivals at `rate` requests/s for `duration_s` seconds."""
    check_positive(rate=rate, duration_s=duration_s)
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate, 0.0, duration_s)
    return Trace(
        tuple(_make_requests(arrivals, rng, prompt_tokens, max_tokens, priorities)), f"poisson-{rate:g}rps-seed{seed}"
    )


def on_off_bursts(
    rate_on: float,
    rate_off: float,
    on_s: float,
    off_s: float,
    duration_s: float,
    seed: int = 0,
    prompt_tokens: tuple[int, int] = (16, 64),
    max_tokens: tuple[int, int] = (16, 32),
    priorities: tuple[int, ...] = (DEFAULT_PRIORITY,),
) -> Trace:
    """Alternate `on_s` seconds of Poisson arrivals at `rate_on` with `off_s` seconds at `rate_off` (may be 0)."""
    check_positive(rate_on=rate_on, on_s=on_s, off_s=off_s, duration_s=duration_s)
    if rate_off < 0:
        raise TraceError(f"rate_off must be >= 0, got {rate_off}")
    rng = np.random.default_rng(seed)
    arrivals, t = [], 0.0
    while t < duration_s:
        arrivals += poisson_arrivals(rng, rate_on, t, min(t + on_s, duration_s))
        t += on_s
        if rate_off > 0 and t < duration_s:
            arrivals += poisson_arrivals(rng, rate_off, t, min(t + off_s, duration_s))
        t += off_s
    return Trace(
        tuple(_make_requests(arrivals, rng, prompt_tokens, max_tokens, priorities)),
        f"bursts-{rate_on:g}on-{rate_off:g}off-seed{seed}",
    )


def diurnal(
    min_rate: float,
    max_rate: float,
    period_s: float,
    duration_s: float,
    seed: int = 0,
    prompt_tokens: tuple[int, int] = (16, 64),
    max_tokens: tuple[int, int] = (16, 32),
    priorities: tuple[int, ...] = (DEFAULT_PRIORITY,),
) -> Trace:
    """A daily ramp compressed to `period_s`: the rate follows a cosine from `min_rate` (t=0) up to `max_rate`
    (t=period/2) and back. Non-homogeneous Poisson arrivals drawn by thinning."""
    check_positive(max_rate=max_rate, period_s=period_s, duration_s=duration_s)
    if not 0 <= min_rate <= max_rate:
        raise TraceError(f"need 0 <= min_rate <= max_rate, got {min_rate} and {max_rate}")
    rng = np.random.default_rng(seed)
    candidates = poisson_arrivals(rng, max_rate, 0.0, duration_s)
    keep = rng.random(len(candidates))
    arrivals = [
        t
        for t, u in zip(candidates, keep, strict=True)
        if u * max_rate <= min_rate + (max_rate - min_rate) * (1 - math.cos(2 * math.pi * t / period_s)) / 2
    ]
    return Trace(
        tuple(_make_requests(arrivals, rng, prompt_tokens, max_tokens, priorities)),
        f"diurnal-{min_rate:g}-{max_rate:g}rps-seed{seed}",
    )


@functools.cache
def shipped_azure() -> Trace:
    """The shipped conversation hour, parsed once (a Trace is immutable): the generators draw from it."""
    return load_azure(AZURE_TRACE)


def with_azure_mix(trace: Trace, scale: float, seed: int = 0) -> Trace:
    """The trace's arrivals with (prompt, output) token pairs drawn from the Azure conversation hour, scaled."""
    azure = shipped_azure()
    pairs = [(r.prompt_tokens or 1, r.max_tokens) for r in azure.requests]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pairs), size=len(trace.requests))
    requests = [
        dataclasses.replace(
            r,
            prompt_tokens=max(1, round(pairs[i][0] * scale)),
            max_tokens=max(1, round(pairs[i][1] * scale)),
        )
        for r, i in zip(trace.requests, picks, strict=True)
    ]
    return trace.with_requests(requests, f"Azure conversation token mix x{scale:g}")


# The shipped traces and how they were made (`python -m overlap.bench.traces` rewrites them; a test checks that the
# files match). Sized for the tiny default model on a 2-core CPU. `steady` stays under what continuous batching
# serves there. `bursty` (what the scheduling analysis and its figures use) offers more than continuous batching
# serves at all: 2 s bursts at 300 req/s and 2 s lulls at 60 req/s, ~180 req/s on average, about 3x what
# continuous batching serves on that machine (5x in the bursts). So a backlog remains at the drain deadline for
# every policy, even on a faster engine, and throughput measures each policy's capacity, not the offered rate.
# Short prompts and long, widely spread outputs (4-12 and 16-128 tokens) make it a decode-heavy workload, where
# batching pays most, and give the static policies the head-of-line blocking real output lengths cause.
BUILTIN_RECIPES = {
    "steady": lambda: poisson(rate=24, duration_s=30, seed=11, prompt_tokens=(8, 24), max_tokens=(24, 40)),
    "bursty": lambda: on_off_bursts(
        rate_on=300, rate_off=60, on_s=2, off_s=2, duration_s=20, seed=12, prompt_tokens=(4, 12), max_tokens=(16, 128)
    ),
    "bursty_2x": lambda: inject_burst(BUILTIN_RECIPES["bursty"](), at_s=8, length_s=4, factor=2, seed=13),
    # Two days of 40 s each (night trough 60 req/s, afternoon peak 420), the Azure hour's token mix at the control
    # replay's scale, and one 1.5x burst per day: on the morning ramp of day one, just after the peak of day two.
    "diurnal": lambda: inject_burst(
        inject_burst(
            with_azure_mix(diurnal(60, 420, period_s=40, duration_s=80, seed=14), scale=0.05, seed=14),
            at_s=12,
            length_s=1.5,
            factor=1.5,
            seed=15,
        ),
        at_s=63,
        length_s=1.5,
        factor=1.5,
        seed=16,
    ),
}


def write_builtin_traces(directory: Path = TRACES_DIR) -> list[Path]:
    paths = []
    for name, recipe in BUILTIN_RECIPES.items():
        path = directory / f"{name}.jsonl"
        recipe().save_jsonl(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_builtin_traces():
        print(f"wrote {written}: {load_trace(written).describe()}")
