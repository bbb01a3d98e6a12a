"""Request traces for the scheduling analysis: load, generate, transform.

A trace is a list of requests, each with an arrival offset (seconds from the start of the trace), a prompt (text
or a token count), a maximum number of output tokens and a priority. Generators are seeded and return the same
trace for the same seed; transforms return a new trace and record what they did in `Trace.transforms`, so every
figure can say which scaling produced it.

File formats (one request per line/row):

- JSONL: `{"arrival_s": 0.12, "prompt_tokens": 64, "max_tokens": 32, "priority": 1}` (or `"prompt": "text"`
  instead of `prompt_tokens`; `priority` is optional, default 1).
- CSV with a header: `arrival_s,prompt_tokens,max_tokens,priority` (or a `prompt` column).
- The Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`), recognised by its header.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from overlap.engine.errors import OverlapError

TRACES_DIR = Path(__file__).with_name("traces")
AZURE_TRACE = TRACES_DIR / "azure" / "azure-llm-2023-conv.csv"
# Names `--trace` accepts besides a file path.
BUILTIN_TRACES = {
    "steady": TRACES_DIR / "steady.jsonl",
    "bursty": TRACES_DIR / "bursty.jsonl",
    "bursty_2x": TRACES_DIR / "bursty_2x.jsonl",
    "diurnal": TRACES_DIR / "diurnal.jsonl",
    "azure": AZURE_TRACE,
}
DEFAULT_PRIORITY = 1
_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(OverlapError):
    """A trace file or trace argument that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # offset from the start of the trace
    max_tokens: int
    prompt_tokens: int | None = None  # exactly one of prompt_tokens / prompt is set
    prompt: str | None = None
    priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_tokens is None):
            raise TraceError("a trace request needs exactly one of 'prompt' (text) or 'prompt_tokens' (a count)")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise TraceError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if self.max_tokens < 1:
            raise TraceError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.prompt_tokens is not None and self.prompt_tokens < 1:
            raise TraceError(f"prompt_tokens must be >= 1, got {self.prompt_tokens!r}")
        if self.prompt is not None and not self.prompt:
            raise TraceError("prompt must not be empty")
        if self.priority < 0:
            raise TraceError(f"priority must be >= 0, got {self.priority!r}")

    def to_dict(self) -> dict:
        out = {"arrival_s": round(self.arrival_s, 6)}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["prompt_tokens"] = self.prompt_tokens
        out["max_tokens"] = self.max_tokens
        out["priority"] = self.priority
        return out


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]  # sorted by arrival
    name: str = "trace"
    transforms: tuple[str, ...] = ()  # what was applied, in order, e.g. "rate x0.05"

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(sorted(self.requests, key=lambda r: r.arrival_s)))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace's span."""
        return len(self) / self.duration_s if self.duration_s > 0 else float(len(self))

    def describe(self) -> str:
        """One line: name, size, rate and the transforms applied (printed next to every figure)."""
        tokens = [r.prompt_tokens for r in self.requests if r.prompt_tokens is not None]
        outs = [r.max_tokens for r in self.requests]
        parts = [f"{self.name}: {len(self)} requests over {self.duration_s:.1f} s ({self.mean_rate:.2f} req/s)"]
        if tokens:
            parts.append(f"prompt tokens median {int(np.median(tokens))}")
        if outs:
            parts.append(f"max output tokens median {int(np.median(outs))}")
        parts.append("transforms: " + (", ".join(self.transforms) if self.transforms else "none"))
        return "; ".join(parts)

    def with_requests(self, requests: Iterable[TraceRequest], transform: str) -> Trace:
        return Trace(tuple(requests), self.name, (*self.transforms, transform))

    def save_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for r in self.requests:
                f.write(json.dumps(r.to_dict()) + "\n")


# ---------------------------------------------------------------------------------------------------- loading


# What a built-in trace already holds, so `describe()` says it next to every figure.
_BUILTIN_NOTES = {
    "bursty_2x": "shipped with a 2x burst at 8 s for 4 s",
    "azure": "Azure LLM inference trace 2023 (conversation), CC-BY 4.0",
}


def resolve_trace(name_or_path: str) -> Trace:
    """A built-in trace by name (steady, bursty, bursty_2x, diurnal, azure) or a file path (generated families,
    `FAMILY:SEED`: overlap.bench.trace_families.resolve)."""
    path = BUILTIN_TRACES.get(name_or_path)
    if path is None:
        path = Path(name_or_path)
        if not path.is_file():
            raise TraceError(
                f"trace {name_or_path!r} is neither a file nor a built-in trace ({', '.join(BUILTIN_TRACES)})"
            )
    trace = load_trace(path)
    note = _BUILTIN_NOTES.get(name_or_path)
    return Trace(trace.requests, trace.name, (note,)) if note else trace


def load_trace(path: str | Path) -> Trace:
    """Load a JSONL or CSV trace (the Azure format is recognised by its header)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return load_jsonl(path)
    if suffix == ".csv":
        return load_azure(path) if is_azure_csv(path) else load_csv(path)
    raise TraceError(f"{path}: unknown trace format {suffix!r} (use .jsonl or .csv)")


def is_azure_csv(path: str | Path) -> bool:
    """A CSV file in the Azure LLM inference trace's schema (TIMESTAMP,ContextTokens,GeneratedTokens)."""
    path = Path(path)
    if path.suffix.lower() != ".csv" or not path.is_file():
        return False
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    return bool(header) and tuple(h.strip() for h in header[:3]) == _AZURE_HEADER


def _request_from_fields(fields: dict, where: str) -> TraceRequest:
    """Build a request from a parsed line/row; every problem raises TraceError naming `where` and the reason."""

    def number(key: str, kind, required: bool = True, default=None):
        value = fields.get(key)
        if value is None or value == "":
            if required:
                raise TraceError(f"{where}: missing field {key!r}")
            return default
        try:
            parsed = kind(value)
            if kind is int and isinstance(value, float | str) and float(value) != parsed:
                raise ValueError
        except (TypeError, ValueError):
            raise TraceError(
                f"{where}: field {key!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}"
            ) from None
        return parsed

    unknown = set(fields) - {"arrival_s", "prompt", "prompt_tokens", "max_tokens", "priority"}
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    prompt = fields.get("prompt") or None
    if prompt is not None and not isinstance(prompt, str):
        raise TraceError(f"{where}: field 'prompt' must be text, got {type(prompt).__name__}")
    try:
        return TraceRequest(
            arrival_s=number("arrival_s", float),
            max_tokens=number("max_tokens", int),
            prompt_tokens=number("prompt_tokens", int, required=False),
            prompt=prompt,
            priority=number("priority", int, required=False, default=DEFAULT_PRIORITY),
        )
    except TraceError as exc:
        if str(exc).startswith(where):
            raise
        raise TraceError(f"{where}: {exc}") from None


def load_jsonl(path: str | Path) -> Trace:
    path = Path(path)
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(fields, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(fields).__name__}")
            requests.append(_request_from_fields(fields, where))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return Trace(tuple(requests), path.stem)


def load_csv(path: str | Path) -> Trace:
    path = Path(path)
    requests = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "arrival_s" not in reader.fieldnames:
            raise TraceError(f"{path}:1: the header must name arrival_s, max_tokens and prompt or prompt_tokens")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:
                raise TraceError(f"{where}: more values than header columns")
            requests.append(_request_from_fields({k.strip(): v for k, v in row.items() if v is not None}, where))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return Trace(tuple(requests), path.stem)


def load_azure(path: str | Path = AZURE_TRACE) -> Trace:
    """The Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens) as offsets from its first row."""
    path = Path(path)
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        next(reader, None)
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if len(row) != 3:
                raise TraceError(f"{where}: expected 3 columns (TIMESTAMP,ContextTokens,GeneratedTokens)")
            try:
                stamp = datetime.fromisoformat(row[0][:26])  # microseconds; the file has 7 fractional digits
                context, generated = int(row[1]), int(row[2])
            except ValueError as exc:
                raise TraceError(f"{where}: {exc}") from None
            rows.append((stamp, max(context, 1), max(generated, 1)))
    if not rows:
        raise TraceError(f"{path}: the trace holds no requests")
    start = min(r[0] for r in rows)
    requests = [
        TraceRequest(arrival_s=(stamp - start).total_seconds(), prompt_tokens=context, max_tokens=generated)
        for stamp, context, generated in rows
    ]
    # the shipped conversation trace keeps its report name; another file in this format is named by its file
    name = "azure-conv" if path.resolve() == AZURE_TRACE.resolve() else path.stem
    return Trace(tuple(requests), name)


def check_positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise TraceError(f"{key} must be > 0, got {value}")


# ---------------------------------------------------------------------------------------------------- transforms


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Multiply the arrival rate by `factor` (arrival offsets are divided by it)."""
    check_positive(factor=factor)
    return trace.with_requests(
        (dataclasses.replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests), f"rate x{factor:g}"
    )


def scale_tokens(
    trace: Trace, factor: float, max_prompt_tokens: int | None = None, max_output_tokens: int | None = None
) -> Trace:
    """Multiply prompt token counts and max output tokens by `factor` (at least 1 each, optionally capped).
    Text prompts are kept as they are (only their max output tokens scale)."""
    check_positive(factor=factor)

    def scaled(count: int, cap: int | None) -> int:
        value = max(1, round(count * factor))
        return min(value, cap) if cap else value

    requests = [
        dataclasses.replace(
            r,
            prompt_tokens=None if r.prompt_tokens is None else scaled(r.prompt_tokens, max_prompt_tokens),
            max_tokens=scaled(r.max_tokens, max_output_tokens),
        )
        for r in trace.requests
    ]
    caps = "".join(
        f", {name} cap {cap}" for name, cap in (("prompt", max_prompt_tokens), ("output", max_output_tokens)) if cap
    )
    return trace.with_requests(requests, f"tokens x{factor:g}{caps}")


def inject_burst(trace: Trace, at_s: float, length_s: float, factor: float = 2.0, seed: int = 0) -> Trace:
    """Multiply the arrival rate by `factor` between `at_s` and `at_s + length_s`: each request in the window is
    joined by (factor - 1) copies on average, placed at uniform random times inside the window."""
    check_positive(length_s=length_s)
    if at_s < 0 or factor < 1:
        raise TraceError(f"need at_s >= 0 and factor >= 1, got at_s={at_s}, factor={factor}")
    rng = np.random.default_rng(seed)
    window = [r for r in trace.requests if at_s <= r.arrival_s < at_s + length_s]
    extra = []
    for r in window:
        copies = int(factor - 1) + (1 if rng.random() < (factor - 1) % 1 else 0)
        for _ in range(copies):
            extra.append(dataclasses.replace(r, arrival_s=float(at_s + rng.random() * length_s)))
    return trace.with_requests(
        (*trace.requests, *extra), f"{factor:g}x burst at {at_s:g} s for {length_s:g} s (+{len(extra)} requests)"
    )


def truncate(trace: Trace, duration_s: float | None = None, max_requests: int | None = None) -> Trace:
    """Keep the requests arriving before `duration_s` and at most the first `max_requests`."""
    requests = list(trace.requests)
    parts = []
    if duration_s is not None:
        check_positive(duration_s=duration_s)
        requests = [r for r in requests if r.arrival_s < duration_s]
        parts.append(f"first {duration_s:g} s")
    if max_requests is not None:
        check_positive(max_requests=max_requests)
        requests = requests[:max_requests]
        parts.append(f"first {max_requests} requests")
    if not requests:
        raise TraceError(f"truncating {trace.name} ({', '.join(parts)}) leaves no requests")
    return trace.with_requests(requests, "truncated to " + " and ".join(parts) if parts else "truncate (no-op)")


def shift_to_zero(trace: Trace) -> Trace:
    """Move the first arrival to t=0 (after truncating a trace somewhere in the middle)."""
    if not trace.requests or trace.requests[0].arrival_s == 0:
        return trace
    first = trace.requests[0].arrival_s
    return Trace(
        tuple(dataclasses.replace(r, arrival_s=r.arrival_s - first) for r in trace.requests),
        trace.name,
        trace.transforms,
    )


@dataclass(slots=True)
class TraceTransforms:
    """The transforms the replay command line asks for, applied in a fixed order: window, rate, tokens, burst."""

    start_s: float = 0.0  # skip the trace's first seconds (e.g. to pick a busy stretch of the Azure hour)
    duration_s: float | None = None  # applied to the original time axis
    scale_rate: float = 1.0
    scale_tokens: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    burst: tuple[float, float, float] | None = None  # (at_s, length_s, factor) on the scaled time axis
    extra: list[str] = field(default_factory=list)

    def apply(self, trace: Trace) -> Trace:
        if self.start_s:
            kept = [r for r in trace.requests if r.arrival_s >= self.start_s]
            if not kept:
                raise TraceError(f"no requests after {self.start_s:g} s in {trace.name}")
            trace = shift_to_zero(trace.with_requests(kept, f"from {self.start_s:g} s"))
        if self.duration_s is not None:
            trace = truncate(trace, duration_s=self.duration_s)
        if self.scale_rate != 1:
            trace = scale_rate(trace, self.scale_rate)
        if self.scale_tokens != 1 or self.max_prompt_tokens or self.max_output_tokens:
            trace = scale_tokens(trace, self.scale_tokens, self.max_prompt_tokens, self.max_output_tokens)
        if self.burst is not None:
            trace = inject_burst(trace, *self.burst)
        return trace
