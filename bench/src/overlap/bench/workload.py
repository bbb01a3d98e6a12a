"""The workload every replay shares: a trace loaded and transformed from the command line's flags, and each
request's prompt as token ids (the same ids for the same trace and seed, whatever is replayed)."""

from __future__ import annotations

import argparse

import numpy as np

from overlap.bench.trace_families import resolve
from overlap.bench.traces import Trace, TraceError, TraceRequest, TraceTransforms, truncate

QUICK_TRACE_S = 15.0  # --quick replays the first seconds of the trace
_PROMPT_ID_RANGE = (10, 1000)  # token ids for count-only prompts: ordinary ids of any vocabulary


def prompt_token_ids(request: TraceRequest, index: int, seed: int, encode=None, vocab_size: int = 1000) -> list[int]:
    """The prompt as token ids: text through `encode`, a count as ids drawn from a per-request seeded generator
    (the same ids for the same trace and seed, whatever the policy)."""
    if request.prompt is not None:
        if encode is not None:
            return encode(request.prompt)
        return [_PROMPT_ID_RANGE[0] + b % (vocab_size - _PROMPT_ID_RANGE[0]) for b in request.prompt.encode()]
    rng = np.random.default_rng([seed, index])
    high = min(_PROMPT_ID_RANGE[1], vocab_size)
    return rng.integers(_PROMPT_ID_RANGE[0], high, size=request.prompt_tokens).tolist()


def fit_to_context(tokens: list[int], max_tokens: int, max_model_len: int) -> tuple[list[int], int]:
    """Shorten a prompt (then max_tokens) so prompt + max_tokens fits the model's context."""
    max_tokens = min(max_tokens, max_model_len // 2)
    tokens = tokens[: max(1, max_model_len - max_tokens)]
    return tokens, max_tokens


def add_transform_arguments(parser) -> None:
    """The trace-transform flags `load_for_args` reads (shared with `overlap bench control`)."""
    scaling = parser.add_argument_group("trace transforms (printed next to every figure)")
    scaling.add_argument("--start-s", type=float, default=0.0, help="skip the trace's first seconds")
    scaling.add_argument("--duration-s", type=float, help="keep this many seconds of the (unscaled) trace")
    scaling.add_argument("--scale-rate", type=float, default=1.0, help="multiply the arrival rate")
    scaling.add_argument("--scale-tokens", type=float, default=1.0, help="multiply prompt and output token counts")
    scaling.add_argument("--max-prompt-tokens", type=int, help="cap prompt tokens after scaling")
    scaling.add_argument("--max-output-tokens", type=int, help="cap output tokens after scaling")
    scaling.add_argument("--burst", help="inject a burst: AT_S:LENGTH_S[:FACTOR] on the scaled time axis (FACTOR 2)")


def parse_sim_cost(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        fixed_ms, per_token_us = (float(v) for v in text.split(","))
    except ValueError:
        raise TraceError(f"--sim-cost: expected FIXED_MS,PER_TOKEN_US, e.g. 8,700; got {text!r}") from None
    if fixed_ms < 0 or per_token_us < 0:
        raise TraceError(f"--sim-cost: both numbers must be >= 0, got {text!r}")
    return fixed_ms, per_token_us


def parse_burst(text: str | None) -> tuple[float, float, float] | None:
    if not text:
        return None
    parts = text.split(":")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise TraceError(f"--burst: expected AT_S:LENGTH_S[:FACTOR] in seconds, got {text!r}") from None
    if len(values) not in (2, 3):
        raise TraceError(f"--burst: expected AT_S:LENGTH_S[:FACTOR], got {text!r}")
    return (values[0], values[1], values[2] if len(values) == 3 else 2.0)


def load_for_args(args: argparse.Namespace) -> Trace:
    trace = resolve(args.trace)
    transforms = TraceTransforms(
        start_s=args.start_s,
        duration_s=args.duration_s,
        scale_rate=args.scale_rate,
        scale_tokens=args.scale_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        burst=parse_burst(args.burst),
    )
    trace = transforms.apply(trace)
    if args.quick and trace.duration_s > QUICK_TRACE_S:
        trace = truncate(trace, duration_s=QUICK_TRACE_S)
    return trace
