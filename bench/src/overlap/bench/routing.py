"""`overlap bench routing`: the same workload through `overlap router` with each routing policy, in front of the
same replicas, on one machine: throughput, TTFT p50/p90 and the share of prompt tokens served from prefix caches.

Replicas are `overlap serve` processes: by default on the simulated device (a step costs `fixed_s + per_token_s x
tokens`, using no CPU, with the engine's real scheduler and KV accounting, so a prefix-cache hit saves the prefill
it saves on a GPU and a replica's cache holds what its pool holds); `--real` runs the tiny model on the CPU
instead. Each policy gets fresh replicas (empty caches) and a fresh router. Every request is a streamed completion
of token ids (no tokenizer in the way) with a session header per conversation.

Workloads (each conversation runs its turns in order; `--concurrency` conversations at once):
- shared-prefix: a scaled form of llm-d's shared-prefix benchmark: 24 groups of 8 users share a 2048-token system
  prompt, each user a 3-turn chat of 128-token questions and 16-token answers (the next turn's prompt is the
  previous one, an answer, a new question). All system prompts together exceed one replica's KV pool and fit in
  the fleet's: a replica that gets every group recomputes them.
- agent: long, growing contexts: 12 agents of 8 steps, a 768-token start, each step appending a 128-384-token
  tool result to everything before it.
- no-sharing: 96 unique prompts of 256-1024 tokens, one turn each (routing can only balance load).

A next turn appends stand-in answer tokens, not the model's own, so only the previous prompt is a cache hit (as
when a client's re-tokenized answer differs); the replica must still hold it. `--kv-blocks` sizes each replica's
pool below the whole working set, as real pools are: random routing makes every replica cache every group.

The pick latency figure comes from the picker itself, timed in this process on an index of the run's size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKLOADS = ("shared-prefix", "agent", "no-sharing")
POLICIES = ("random", "round-robin", "least-queue", "approx", "prefix")


@dataclass
class Conversation:
    session: str
    turns: list[tuple[list[int], int]]  # (tokens appended to the history, output tokens)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]


def make_workload(name: str, scale: float, seed: int = 0) -> list[Conversation]:
    """The conversations of a workload, interleaved; `scale` multiplies their number (not their lengths)."""
    rng = random.Random(seed)
    conversations = []
    if name == "shared-prefix":
        groups, users, turns = max(2, round(24 * scale)), 8, 3
        for g in range(groups):
            system = _tokens(rng, 2048)
            for u in range(users):
                chat = [(system + _tokens(rng, 128), 16)] + [(_tokens(rng, 128), 16) for _ in range(turns - 1)]
                conversations.append(Conversation(f"g{g}u{u}", chat))
    elif name == "agent":
        for a in range(max(2, round(12 * scale))):
            steps = [(_tokens(rng, 768), 16)] + [(_tokens(rng, rng.randrange(128, 384)), 16) for _ in range(7)]
            conversations.append(Conversation(f"agent{a}", steps))
    elif name == "no-sharing":
        for i in range(max(4, round(96 * scale))):
            conversations.append(Conversation(f"solo{i}", [(_tokens(rng, rng.randrange(256, 1024)), 16)]))
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    rng.shuffle(conversations)
    return conversations


@dataclass
class RunResult:
    workload: str
    policy: str
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict:
        ttft = sorted(self.ttfts_s) or [float("nan")]
        pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
        return {
            "workload": self.workload, "policy": self.policy, "requests": self.requests, "errors": self.errors,
            "output_tok_s": round(self.throughput, 1), "ttft_p50_s": round(pct(0.5), 4),
            "ttft_p90_s": round(pct(0.9), 4), "wall_s": round(self.wall_s, 2),
            "prefix_hit_share": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
        }  # fmt: skip


async def drive(urls: list[str], conversations: list[Conversation], concurrency: int, result: RunResult,
                rate: float | None = None) -> None:  # fmt: skip
    """Run every conversation (turns in order), streaming each answer: `concurrency` at a time (a closed loop), or
    with `rate`, conversations starting as a Poisson process of that many per second (an open loop: a policy that
    cannot keep up builds a queue, as at saturation). Each request goes to one of `urls` at random (a Service in
    front of several routers)."""
    import aiohttp

    pending = list(reversed(conversations))
    answer_rng, router_rng = random.Random(1), random.Random(3)
    model = None

    async def turn(session: aiohttp.ClientSession, sid: str, prompt: list[int], output: int) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": output, "ignore_eos": True, "temperature": 0.0,
                "stream": True}  # fmt: skip
        started = time.monotonic()
        first = None
        url = router_rng.choice(urls)
        async with session.post(f"{url}/v1/completions", json=body, headers={"x-session-id": sid}) as response:
            if response.status != 200:
                await response.read()
                result.errors += 1
                return
            async for raw in response.content:
                if first is None and raw.startswith(b"data: {"):
                    first = time.monotonic()
        result.requests += 1
        result.output_tokens += output
        if first is not None:
            result.ttfts_s.append(first - started)

    async def converse(session: aiohttp.ClientSession, conversation: Conversation) -> None:
        history: list[int] = []
        for added, output in conversation.turns:
            prompt = history + added
            await turn(session, conversation.session, prompt, output)
            history = prompt + _tokens(answer_rng, output)  # a stand-in answer: see the module's docstring

    async def worker(session: aiohttp.ClientSession) -> None:
        while pending:
            await converse(session, pending.pop())

    async def arrivals(session: aiohttp.ClientSession) -> None:
        arrival_rng = random.Random(2)
        tasks = []
        while pending:
            tasks.append(asyncio.create_task(converse(session, pending.pop())))
            await asyncio.sleep(arrival_rng.expovariate(rate))
        await asyncio.gather(*tasks)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.get(f"{urls[0]}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        started = time.monotonic()
        if rate:
            await arrivals(session)
        else:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        result.wall_s = time.monotonic() - started


# ---- processes -----------------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, what: str, timeout: float = 120) -> None:
    from overlap.serve import get_json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        try:
            if get_json(f"{url}/readyz", timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} was not ready within {timeout:g} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def run_policy(args: argparse.Namespace, workload: str, policy: str, engine_config: Path) -> RunResult:
    """Fresh replicas and a fresh router with `policy`; the workload through it; the replicas' cache figures."""
    overlap = [sys.executable, "-m", "overlap.cli", "--log-level", "WARNING"]
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(args.replicas):
            port = _free_port()
            cmd = [*overlap, "serve", "--port", str(port), "--config", str(engine_config),
                   "--max-queued-requests", "1000", "--max-inflight", "1000"]  # fmt: skip
            if args.model:
                cmd += ["--model", args.model]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            _wait_ready(proc, url, "overlap serve")
        router_urls = []
        for _ in range(args.routers):
            port = _free_port()
            router = subprocess.Popen([*overlap, "router", "--port", str(port), "--policy", policy,
                                       *[a for url in urls for a in ("--replica", url)]],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            procs.append(router)
            router_urls.append(f"http://127.0.0.1:{port}")
            _wait_ready(router, router_urls[-1], "overlap router")
        time.sleep(0.3)  # every replica polled once
        result = RunResult(workload, policy)
        conversations = make_workload(workload, args.scale, args.seed)
        asyncio.run(drive(router_urls, conversations, args.concurrency, result, args.rate))
        result.prompt_tokens = sum(_metric(u, "overlap_prompt_tokens_total") for u in urls)
        result.cached_tokens = sum(_metric(u, "overlap_prompt_cached_tokens_total") for u in urls)
        return result
    finally:
        _stop(procs)


def tokenize_cost(model_dir: str | None = None, repeats: int = 50) -> list[dict]:
    """What the router adds per request by tokenizing for scoring: the median time of a plain prompt and of the same
    text through the chat template, at three prompt sizes (the model's tokenizer; the tiny model's by default)."""
    from overlap.engine.model.builder import ensure_default_model
    from overlap.openai.text import TextProcessor

    text = TextProcessor(model_dir or ensure_default_model())
    words = ["the", "river", "turned", "north", "past", "the", "old", "mill", "and", "the", "bridge"]
    rows = []
    for num_words in (100, 1000, 4000):
        prompt = " ".join(words[i % len(words)] for i in range(num_words))
        messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "hi there"}]
        row = {"tokens": len(text.encode(prompt))}
        for name, call, arg in (("encode_ms", text.encode, prompt), ("chat_ms", text.encode_chat, messages)):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                call(arg)
                times.append(time.perf_counter() - started)
            row[name] = 1000 * statistics.median(times)
        rows.append(row)
    return rows


def pick_latency(num_replicas: int, blocks_per_replica: int, prompt_blocks: int, picks: int = 2000) -> dict:
    """The picker alone on an index of `num_replicas` x `blocks_per_replica` blocks: p50/p99 of one pick."""
    from overlap.gateway.router.picker import Picker, ReplicaState

    rng = random.Random(0)
    picker = Picker("prefix", seed=0)
    replicas = [ReplicaState(f"r{i}", ready=True) for i in range(num_replicas)]
    chains = [[rng.getrandbits(63) for _ in range(prompt_blocks)] for _ in range(64)]
    for i, replica in enumerate(replicas):
        held = [h for chain in chains[i::num_replicas] for h in chain]
        held += [rng.getrandbits(63) for _ in range(max(0, blocks_per_replica - len(held)))]
        picker.index.apply(replica.url, [(1, h) for h in held], reset=True)
    times = []
    for n in range(picks):
        chain = chains[n % len(chains)]
        started = time.perf_counter()
        picker.pick(replicas, chain, 16, 16 * prompt_blocks)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"p50_ms": 1000 * times[len(times) // 2], "p99_ms": 1000 * times[int(0.99 * len(times))],
            "index_blocks": len(picker.index), "prompt_blocks": prompt_blocks}  # fmt: skip


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "routing", help="routing policies through `overlap router` in front of the same replicas",
        description=__doc__.splitlines()[0],
    )  # fmt: skip
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: all)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all)")
    parser.add_argument("--replicas", type=int, default=4, help="replicas behind the router (default 4)")
    parser.add_argument("--routers", type=int, default=1,
                        help="routers in front of the replicas, each request to one at random (default 1)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=48, help="conversations at once (default 48)")
    parser.add_argument("--rate", type=float,
                        help="conversations starting per second (an open loop), instead of --concurrency")  # fmt: skip
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the number of conversations")
    parser.add_argument("--kv-blocks", type=int, default=2048,
                        help="KV blocks of 16 tokens per replica (default 2048: below the working set)")  # fmt: skip
    parser.add_argument("--fixed-ms", type=float, default=8.0, help="simulated step: fixed ms (default 8)")
    parser.add_argument("--per-token-us", type=float, default=120.0,
                        help="simulated step: us per token (default 120)")  # fmt: skip
    parser.add_argument("--real", action="store_true", help="the tiny model on the CPU instead of the simulated device")
    parser.add_argument("--model", help="model folder for the replicas (default: the tiny model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="a small run: 2 replicas, few conversations")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    workloads = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(workloads) - set(WORKLOADS)) + sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"overlap bench routing: unknown workload or policy: {', '.join(unknown)}")
    if args.routers < 1:
        raise SystemExit("overlap bench routing: --routers must be at least 1")
    if args.quick:
        args.replicas, args.scale, args.concurrency = 2, 0.25, 8
    config = {"num_kv_blocks": args.kv_blocks, "max_seq_len": 4096, "max_num_seqs": 32, "num_threads": 1}
    if not args.real:
        config["simulated_device"] = {"fixed_s": args.fixed_ms / 1000, "per_token_s": args.per_token_us / 1e6}
    with tempfile.TemporaryDirectory(prefix="overlap-routing-") as tmp:
        engine_config = Path(tmp) / "engine.json"
        engine_config.write_text(json.dumps(config))
        device = "the tiny model on the CPU" if args.real else (
            f"simulated device ({args.fixed_ms:g} ms + {args.per_token_us:g} us/token)")  # fmt: skip
        load = f"{args.rate:g} conversations/s" if args.rate else f"{args.concurrency} conversations at once"
        routers = f", {args.routers} routers" if args.routers > 1 else ""
        print(f"overlap bench routing: {args.replicas} replicas{routers}, {device}, {args.kv_blocks} KV blocks each, "
              f"{load}", flush=True)  # fmt: skip
        rows = []
        for workload in workloads:
            for policy in policies:
                result = run_policy(args, workload, policy, engine_config)
                rows.append(result.summary())
                r = rows[-1]
                print(f"  {workload:13s} {policy:11s} {r['output_tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50_s']:.3f} "
                      f"p90 {r['ttft_p90_s']:.3f} s  hits {r['prefix_hit_share']:.1%}  errors {r['errors']}",
                      flush=True)  # fmt: skip
    picks = pick_latency(args.replicas, args.kv_blocks * 8, 256)
    print(_table(rows))
    print(f"\npick latency (prefix policy, {picks['index_blocks']} indexed blocks, a {picks['prompt_blocks']}-block "
          f"prompt): p50 {picks['p50_ms']:.3f} ms, p99 {picks['p99_ms']:.3f} ms (goal < 1 ms)")  # fmt: skip
    tokenize = tokenize_cost(args.model)
    print("tokenizing for scoring (median; plain / through the chat template): " + ", ".join(
        f"{t['tokens']} tokens {t['encode_ms']:.2f} / {t['chat_ms']:.2f} ms" for t in tokenize))  # fmt: skip
    verdicts = _verdicts(rows)
    for line in verdicts:
        print(line)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rows": rows, "pick": picks, "tokenize": tokenize, "verdicts": verdicts}, indent=1)
        )
    return 1 if any(r["errors"] for r in rows) else 0


def _table(rows: list[dict]) -> str:
    lines = ["", "| workload | policy | output tok/s | TTFT p50 s | TTFT p90 s | prefix-hit share | errors |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['workload']} | {r['policy']} | {r['output_tok_s']:.1f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['prefix_hit_share']:.1%} | {r['errors']} |")  # fmt: skip
    return "\n".join(lines)


def _verdicts(rows: list[dict]) -> list[str]:
    """The issue's goals, where the rows to compare exist."""
    by = {(r["workload"], r["policy"]): r for r in rows}
    lines = []

    def have(*keys):
        return all(k in by for k in keys)

    prefix, rand, approx = ("shared-prefix", "prefix"), ("shared-prefix", "random"), ("shared-prefix", "approx")
    if have(prefix, rand):
        tput = by[prefix]["output_tok_s"] / max(by[rand]["output_tok_s"], 1e-9)
        ttft = by[rand]["ttft_p90_s"] / max(by[prefix]["ttft_p90_s"], 1e-9)
        lines.append(f"shared-prefix: prefix / random throughput {tput:.2f}x (goal >= 2), TTFT p90 {ttft:.1f}x lower "
                     f"(goal >= 10)")  # fmt: skip
    if have(prefix, approx):
        tput = by[prefix]["output_tok_s"] / max(by[approx]["output_tok_s"], 1e-9)
        lines.append(f"shared-prefix: prefix / approx throughput {tput:.2f}x (goal >= 1.25)")
    if have(("no-sharing", "prefix"), ("no-sharing", "least-queue")):
        ratio = by[("no-sharing", "prefix")]["output_tok_s"] / max(
            by[("no-sharing", "least-queue")]["output_tok_s"], 1e-9
        )
        lines.append(f"no-sharing: prefix / least-queue throughput {ratio:.2f}x (goal within 5%)")
    return lines
