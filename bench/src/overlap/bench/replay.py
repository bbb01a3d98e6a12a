"""`overlap bench replay`: replay a trace against a batching policy (in-process) or a live endpoint, and report.

In-process (`--policy`, `--compare serial,fixed_window,dynamic,continuous`): one Engine per policy on the default
model, driven from this thread: submit the requests whose arrival time has come, then `step()`. Each request's
arrival time is its trace time, so a late submission counts as queueing. Timestamps come from the engine's
RequestTimes; device-busy time from the executor's busy intervals.

Against an endpoint (`--target URL`, or URLs in `--compare`): every request is an OpenAI `/v1/completions` call
with streaming, sent at its arrival offset; timestamps are taken on the client (sent, each streamed chunk,
finished).

Either way the run is bounded: submission stops at the end of the trace, then the runner drains for at most
`--drain-s` seconds and counts what is left as unfinished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from overlap.bench.meter import SAMPLE_EVERY_S, load_average, progress_bar
from overlap.bench.replay_endpoint import replay_target
from overlap.bench.report import RequestRecord, RunResult, table_rows, text_table, write_report
from overlap.bench.traces import Trace, TraceError
from overlap.bench.workload import (
    QUICK_TRACE_S,
    add_transform_arguments,
    fit_to_context,
    load_for_args,
    parse_sim_cost,
    prompt_token_ids,
)

POLICIES = ("serial", "fixed_window", "dynamic", "continuous")
# Defaults (documented in docs/analysis.md). dynamic: sized for the replayed trace's mean arrival rate by the
# advisor's rule (`overlap bench advise`: batch wait ~ max_batch / rate, under half the SLO), capped by the sequence
# cap; the fixed arguments below are field report 2's setting, used only when no rate is known. fixed_window: 50 ms
# windows, a time parameter that does not follow the rate (batch ~ rate x window: ~15 in a 300 req/s burst).
DEFAULT_POLICY_ARGS: dict[str, dict[str, float]] = {
    "serial": {},
    "fixed_window": {"window_ms": 50},
    "dynamic": {"max_batch": 8, "max_wait_ms": 150},
    "continuous": {},
}
# The sequence cap of every policy. On a CPU a step keeps getting cheaper per token well past 64 sequences (measured
# here: ~0.5 ms per token at batch 62, 0.2-0.4 at batch 240), so a cap of 64 rather than the device would limit what
# continuous batching serves.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_SLO_MS = 1000.0
# None: the engine's own default (torch's intra-op threads, one per core), as `overlap serve` runs it.
DEFAULT_NUM_THREADS: int | None = None
DEFAULT_DRAIN_S = 10.0
QUICK_DRAIN_S = 8.0


@dataclass(slots=True)
class RunSpec:
    """One run of a comparison: a batching policy in-process, or an endpoint."""

    label: str
    policy: str | None = None
    policy_args: dict[str, float] = field(default_factory=dict)
    target: str | None = None


def parse_policy_args(text: str | None) -> dict[str, float]:
    """`k=v,k=v` -> {k: float(v)}; a clear error for anything else."""
    args: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise TraceError(f"--policy-args: expected key=value, got {part!r}")
        try:
            args[key.strip()] = float(value)
        except ValueError:
            raise TraceError(f"--policy-args: {key.strip()} must be a number, got {value!r}") from None
    return args


def policy_label(policy: str, args: dict[str, float]) -> str:
    if not args:
        return policy
    return f"{policy}({', '.join(f'{k}={v:g}' for k, v in args.items())})"


def default_policy_args(
    policy: str, rate: float | None = None, slo_ms: float = DEFAULT_SLO_MS, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
) -> tuple[dict[str, float], str | None]:
    """A policy's default arguments, and for `dynamic` with a known arrival rate the advisor's arithmetic that
    sized them (None otherwise)."""
    if policy == "dynamic" and rate:
        from overlap.bench.advise import advise

        advice = advise(rate, slo_ms, max_num_seqs)
        note = (
            f"dynamic arguments from the advisor for the trace's mean rate (`overlap bench advise --rate {rate:.1f} "
            f"--slo-ms {slo_ms:g} --max-batch-cap {max_num_seqs}`): " + "; ".join(advice.arithmetic)
        )
        return {"max_batch": advice.max_batch, "max_wait_ms": advice.max_wait_ms}, note
    return dict(DEFAULT_POLICY_ARGS[policy]), None


def make_specs(
    policies: list[str],
    targets: list[str],
    policy_args: dict[str, float] | None,
    rate: float | None = None,
    slo_ms: float = DEFAULT_SLO_MS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> tuple[list[RunSpec], list[str]]:
    """Run specs for the given policies (each with its default args, or `policy_args` when only one policy is
    asked for) and targets, and notes on how the default arguments were chosen."""
    specs, notes = [], []
    for policy in policies:
        if policy not in POLICIES:
            raise TraceError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        if policy_args and len(policies) == 1:
            args, note = {**DEFAULT_POLICY_ARGS[policy], **policy_args}, None
        else:
            args, note = default_policy_args(policy, rate, slo_ms, max_num_seqs)
        if note:
            notes.append(note)
        specs.append(RunSpec(policy_label(policy, args), policy=policy, policy_args=args))
    for item in targets:
        label, sep, url = item.partition("=")
        if not sep or "://" in label:  # no label given: the URL is the label
            label, url = item, item
        if "://" not in url:
            raise TraceError(f"target {item!r}: expected a URL such as http://127.0.0.1:8000 (or NAME=URL)")
        specs.append(RunSpec(label.rstrip("/"), target=url.rstrip("/")))
    return specs, notes


# ---------------------------------------------------------------------------------------------------- in-process


class _BusyMeter:
    """Device-busy seconds since it was made, as the engine's executor records them from each step's own busy
    interval (the forward's start and end on CPU, CUDA events, the simulated device's exact sleep)."""

    def __init__(self, engine) -> None:
        self.tracker = engine.executor.busy
        self.total0 = self.tracker.busy_s_total

    @property
    def busy_s(self) -> float:
        return self.tracker.busy_s_total - self.total0


def replay_in_process(
    trace: Trace,
    engine,
    label: str,
    config: dict,
    drain_s: float,
    seed: int = 0,
    encode=None,
    progress: bool = True,
) -> RunResult:
    """Replay `trace` on `engine` in real time from this thread; see the module docstring."""
    from overlap.engine import InvalidRequestError, RequestSpec, SamplingParams

    requests = trace.requests
    ids = [f"r{i}" for i in range(len(requests))]
    prepared = []
    for i, r in enumerate(requests):
        tokens = prompt_token_ids(r, i, seed, encode, engine.vocab_size)
        prepared.append(fit_to_context(tokens, r.max_tokens, engine.max_model_len))
    records = {
        rid: RequestRecord(rid, r.arrival_s, num_prompt_tokens=len(p[0]))
        for rid, r, p in zip(ids, requests, prepared, strict=True)
    }
    _warm_up(engine, SamplingParams)
    load_before = load_average()

    bar = progress_bar(len(requests), label, progress)
    busy = _BusyMeter(engine)
    samples = []
    last_sample_t, last_busy = 0.0, 0.0
    num_submitted = 0
    submit_end = None
    start = time.monotonic()
    while True:
        t = time.monotonic() - start
        while num_submitted < len(requests) and requests[num_submitted].arrival_s <= t:
            r, rid = requests[num_submitted], ids[num_submitted]
            tokens, max_tokens = prepared[num_submitted]
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            try:
                engine.add_request(
                    RequestSpec(rid, tokens, sampling, priority=r.priority, arrival_time=start + r.arrival_s)
                )
            except InvalidRequestError as exc:
                records[rid].status, records[rid].detail = "rejected", str(exc)
                bar.update(1)
            num_submitted += 1
        if submit_end is None and num_submitted == len(requests):
            submit_end = t
        if submit_end is not None and (not engine.has_unfinished() or t > submit_end + drain_s):
            break
        if engine.has_unfinished():
            step_start = time.monotonic()
            outputs = engine.step()
            now = time.monotonic()
            for out in outputs:
                _record_output(records[out.request_id], out, now - start, start, bar)
            if not outputs and now - step_start < 0.001:
                # the policy is holding requests back: wait a little instead of spinning
                time.sleep(0.001)
        elif num_submitted < len(requests):
            time.sleep(max(0.0, min(requests[num_submitted].arrival_s - t, 0.05)))
        t = time.monotonic() - start
        if t - last_sample_t >= SAMPLE_EVERY_S:
            busy_s = busy.busy_s
            stats = engine.stats()
            share = min(1.0, (busy_s - last_busy) / (t - last_sample_t))
            # the batch of the last step, not the running set now: sampling right after a request finished would
            # read 0 running, and with a steady step rhythm (serial) every sample can land there
            samples.append((t, stats["num_waiting"], stats["last_batch_size"], share))
            bar.set_postfix(waiting=stats["num_waiting"], running=stats["num_running"], refresh=False)
            last_sample_t, last_busy = t, busy_s
    wall = time.monotonic() - start
    bar.close()
    busy_s = busy.busy_s
    for rid in list(records):
        if records[rid].status == "unfinished":
            engine.abort(rid)
    engine.close()
    config = {**config, "load_average": [load_before, load_average()]}
    return RunResult(
        label=label,
        mode="in-process",
        config=config,
        records=list(records.values()),
        wall_s=wall,
        submit_end_s=submit_end or wall,
        busy_s=busy_s,
        max_batch=config.get("max_num_seqs"),
        samples=samples,
    )


def _record_output(record: RequestRecord, out, t: float, start: float, bar) -> None:
    record.token_times += [t] * len(out.new_token_ids)
    record.num_output_tokens = out.num_output_tokens
    if not out.finished:
        return
    times = out.times
    record.detail = str(out.finish_reason)
    if times is not None:
        record.first_scheduled = None if times.first_scheduled is None else times.first_scheduled - start
        record.first_token = None if times.first_token is None else times.first_token - start
        record.finished = (times.finished if times.finished is not None else start + t) - start
    else:
        record.finished = t
    reason = out.finish_reason.value if out.finish_reason is not None else "stop"
    record.status = {"stop": "finished", "length": "finished", "timeout": "rejected"}.get(reason, "failed")
    if out.error:
        record.detail = out.error
    bar.update(1)


def _warm_up(engine, sampling_cls) -> None:
    """A few short requests before the clock starts: the first forwards pay one-off costs (allocations, kernels)."""
    from overlap.engine import RequestSpec

    for i in range(4):
        engine.add_request(
            RequestSpec(f"warmup{i}", [11 + i, 12, 13, 14, 15, 16, 17, 18], sampling_cls(max_tokens=4, ignore_eos=True))
        )
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        engine.step()


def build_engine(
    policy: str,
    policy_args: dict[str, float],
    max_num_seqs: int,
    num_threads: int | None,
    model: str = "",
    sim_cost: tuple[float, float] | None = None,
    dtype: str = "float32",
):
    """An Engine for one policy on the default model, or on the simulated device when `sim_cost` = (fixed_ms,
    per_token_us) is given (the engine's SimRunner: a step of N tokens takes fixed + N * per_token)."""
    from overlap.engine import Engine, EngineConfig

    config = EngineConfig(
        model=model,
        batching=policy,
        batching_args=dict(policy_args),
        max_num_seqs=max_num_seqs,
        num_threads=num_threads,
        dtype=dtype,
    )
    if sim_cost is None:
        return Engine(config), config
    from overlap.engine.model.sim_runner import CostModel, SimRunner

    runner = SimRunner.from_config(config, CostModel(sim_cost[0] / 1000, sim_cost[1] / 1e6))
    return Engine(config, runner=runner), config


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _tokenizer_encode(model_dir: Path):
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------------- command


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay a trace against batching policies (in-process) or OpenAI-compatible endpoints, and report",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="policy defaults: "
        + "; ".join(f"{p} {json.dumps(a)}" for p, a in DEFAULT_POLICY_ARGS.items() if p != "dynamic")
        + "; dynamic: max_batch and max_wait_ms from `overlap bench advise` for the replayed trace's mean rate and "
        + f"--slo-ms, capped by --max-num-seqs; max_num_seqs {DEFAULT_MAX_NUM_SEQS}",
    )
    parser.add_argument(
        "--trace", default="bursty", help="steady | bursty | bursty_2x | azure | a .jsonl/.csv file (default bursty)"
    )
    parser.add_argument("--policy", choices=POLICIES, help="one in-process batching policy")
    parser.add_argument("--policy-args", help="k=v,... for --policy, e.g. max_batch=16,max_wait_ms=100")
    parser.add_argument(
        "--target", action="append", default=[], help="OpenAI-compatible base URL, or NAME=URL (repeatable)"
    )
    parser.add_argument(
        "--compare", help="comma-separated policies and/or URLs (NAME=URL to label one), run one after another"
    )
    parser.add_argument("--model", help="model name for --target (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", help="bearer token for --target")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"replay only the first {QUICK_TRACE_S:g} s of the trace and drain for at most {QUICK_DRAIN_S:g} s",
    )
    parser.add_argument("--json", action="store_true", help="print the report JSON on stdout (table on stderr)")
    parser.add_argument("--out", help="report folder (default reports/replay-<UTC time>)")
    parser.add_argument(
        "--drain-s",
        type=float,
        help=f"longest wait after the last submission (default {DEFAULT_DRAIN_S:g}, quick {QUICK_DRAIN_S:g})",
    )
    parser.add_argument(
        "--slo-ms",
        type=float,
        default=DEFAULT_SLO_MS,
        help=f"latency SLO for the diagnosis (default {DEFAULT_SLO_MS:g})",
    )
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, help="engine sequence cap")
    parser.add_argument(
        "--num-threads",
        type=int,
        default=DEFAULT_NUM_THREADS,
        help="torch intra-op threads for the in-process engine (default: the engine's, one per core)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="engine dtype for the in-process runs (default float32)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for prompt token ids")
    parser.add_argument(
        "--sim-cost",
        metavar="FIXED_MS,PER_TOKEN_US",
        help="run the policies on the engine's simulated device instead of the model: a step of N "
        "tokens takes FIXED_MS + N x PER_TOKEN_US (fast, for trying policies and traces)",
    )
    add_transform_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run)


def _reproduce_command(argv: list[str]) -> str:
    """The command line that reproduces this report (empty when not run as `overlap ... bench replay ...`)."""
    for i in range(1, len(argv) - 1):
        if argv[i : i + 2] == ["bench", "replay"]:
            return "overlap " + " ".join(shlex.quote(a) for a in argv[1:])
    return ""


def _run(args: argparse.Namespace) -> int:
    policies, targets = [], list(args.target)
    if args.compare:
        for item in filter(None, (s.strip() for s in args.compare.split(","))):
            (targets if "://" in item else policies).append(item)
    if args.policy:
        policies.insert(0, args.policy)
    if not policies and not targets:
        raise TraceError("nothing to run: give --policy, --target or --compare")
    if args.policy_args and len(policies) != 1:
        raise TraceError("--policy-args applies to a single --policy; --compare uses each policy's defaults")
    sim_cost = parse_sim_cost(args.sim_cost)
    trace = load_for_args(args)
    specs, notes = make_specs(
        policies, targets, parse_policy_args(args.policy_args), trace.mean_rate, args.slo_ms, args.max_num_seqs
    )
    drain_s = args.drain_s if args.drain_s is not None else (QUICK_DRAIN_S if args.quick else DEFAULT_DRAIN_S)
    out_dir = Path(args.out or f"reports/replay-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}")
    progress = not args.no_progress
    log = sys.stderr if args.json else sys.stdout
    print(f"trace {trace.describe()}", file=log)
    for note in notes:
        print(note, file=log)
    started = time.monotonic()

    results = []
    encode = None
    for spec in specs:
        if spec.target:
            results.append(
                asyncio.run(
                    replay_target(
                        trace, spec.target, drain_s, args.model, args.api_key, args.seed, progress, spec.label
                    )
                )
            )
        else:
            engine, _ = build_engine(
                spec.policy, spec.policy_args, args.max_num_seqs, args.num_threads, sim_cost=sim_cost, dtype=args.dtype
            )
            if encode is None:
                encode = _tokenizer_encode(engine.model_dir)
            cfg = {
                "batching": spec.policy,
                "batching_args": spec.policy_args,
                "max_num_seqs": args.max_num_seqs,
                "num_threads": args.num_threads or _torch_threads(),
                "dtype": args.dtype,
            }
            if sim_cost:
                cfg["sim_cost"] = {"fixed_ms": sim_cost[0], "per_token_us": sim_cost[1]}
            results.append(replay_in_process(trace, engine, spec.label, cfg, drain_s, args.seed, encode, progress))
            del engine  # free its KV pool before the next policy's engine allocates one
        last = results[-1]
        num_left = sum(r.status == "unfinished" for r in last.records)
        print(
            f"  {spec.label}: {sum(r.status == 'finished' for r in last.records)}/{len(last.records)} finished "
            f"in {last.wall_s:.1f} s, {num_left} still queued or running at the drain deadline (machine load "
            f"average {last.config['load_average'][0]} -> {last.config['load_average'][1]})",
            file=log,
        )

    command = _reproduce_command(sys.argv)
    summary = write_report(results, out_dir, trace.describe(), args.slo_ms, command, notes)
    summary["wall_s"] = round(time.monotonic() - started, 1)
    summary["out_dir"] = str(out_dir)
    (out_dir / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    header, rows = table_rows(summary["runs"])
    print("\n" + text_table(header, rows), file=log)
    for key, value in summary["comparison"].items():
        print(f"{key}: {value}", file=log)
    for run in summary["runs"]:
        print(f"diagnosis {run['label']}: {run['diagnosis']['cause']}", file=log)
    print(f"trace: {trace.describe()}", file=log)
    print(f"report: {out_dir}/report.md (wall {summary['wall_s']:.1f} s)", file=log)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0
