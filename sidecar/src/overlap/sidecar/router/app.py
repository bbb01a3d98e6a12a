"""`overlap router`: one address for several replicas, each request sent where its prompt's KV is cached and the queue
is short (`picker.py` says how it scores).

- Replicas: `--replica URL` (a sidecar's public port), each polled every `--poll-interval-s` at `/v1/kv-events`:
  the blocks its prefix cache added and evicted since the last poll (a snapshot first and after an engine restart),
  its load (waiting, running, KV usage, the sidecar's admission queue) and whether it is ready or draining. The
  block size and hash scheme come from there too, so nothing is configured twice.
- A request: its prompt tokenized once here (the model's tokenizer: `--tokenizer DIR`, else the files a replica
  serves at `/v1/tokenizer`), hashed into blocks, a replica picked, the request relayed as it came (streams chunk
  by chunk). A replica that refuses the connection, answers 5xx or 429 before a byte went to the client is marked
  down (until its next good poll) and the request goes to the next best: nothing accepted is lost while another
  replica is up. One that fails mid-stream cannot be retried (the client has part of the answer).
- `/readyz`: 200 while some replica is ready. `/metrics`: picks by reason, prompt and prefix-hit tokens, the index
  size, pick and tokenize latency, retries, ready replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from overlap.engine.batching.prefix_hash import HASH_SCHEME, block_hashes
from overlap.engine.errors import ConfigError
from overlap.sidecar.activator import HOP_BY_HOP
from overlap.sidecar.http import metrics_handler
from overlap.sidecar.router.picker import POLICIES, Picker, ReplicaState

log = logging.getLogger("overlap.router")
SCORED_PATHS = ("/v1/completions", "/v1/chat/completions")
_OFF_LOOP_CHARS = 4096  # longer prompts are tokenized on a worker thread, so the loop keeps picking


@dataclass(slots=True)
class RouterConfig:
    replicas: list[str]
    policy: str = "prefix"
    host: str = "0.0.0.0"
    port: int = 8000
    poll_interval_s: float = 0.05
    session_header: str = "x-session-id"
    tokenizer: str | None = None
    max_attempts: int = 3
    max_body_bytes: int = 16 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("the router needs at least one --replica URL")
        bad = [r for r in self.replicas if not r.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"--replica must be an http(s) URL, got {bad[0]!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.poll_interval_s <= 0 or self.max_attempts < 1:
            raise ConfigError("--poll-interval-s must be positive and --max-attempts at least 1")
        self.replicas = [r.rstrip("/") for r in self.replicas]


class Router:
    def __init__(self, config: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.replicas = {url: ReplicaState(url) for url in config.replicas}
        self.picker = Picker(config.policy)
        self.text = None  # TextProcessor, once loaded
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        r = self.registry
        self.picks = Counter("overlap_router_picks", "Requests routed, by why the replica won", ["reason"], registry=r)
        self.prompt_tokens = Counter("overlap_router_prompt_tokens", "Prompt tokens of scored requests", registry=r)
        self.hit_tokens = Counter(
            "overlap_router_prefix_hit_tokens", "Prompt tokens the picked replica had cached", registry=r
        )
        self.retries = Counter("overlap_router_retries", "Requests sent again to another replica", registry=r)
        self.failed = Counter("overlap_router_failed_requests", "Requests no replica could take", registry=r)
        self.pick_time = Histogram("overlap_router_pick_seconds", "Scoring and choosing a replica", registry=r,
                                   buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2))  # fmt: skip
        self.tokenize_time = Histogram("overlap_router_tokenize_seconds", "Tokenizing a prompt for scoring",
                                       registry=r, buckets=(1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1))  # fmt: skip
        Gauge("overlap_router_index_blocks", "(replica, block) pairs in the prefix index", registry=r).set_function(
            lambda: len(self.picker.approx if config.policy == "approx" else self.picker.index)
        )
        Gauge("overlap_router_ready_replicas", "Replicas ready and not draining", registry=r).set_function(
            lambda: len(self.candidates())
        )

    # ------------------------------------------------------------------------------------------------ lifecycle
    async def start(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # streams hold their connections; admission limits are the pods'
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(sock_connect=5))
        self._tasks = [asyncio.create_task(self._poll(state)) for state in self.replicas.values()]
        self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    async def stop(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()

    def candidates(self) -> list[ReplicaState]:
        return [r for r in self.replicas.values() if r.ready and not r.draining]

    async def _poll(self, state: ReplicaState) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, 10 * self.config.poll_interval_s))
        while True:
            try:
                params = {"since": str(state.next_seq), "epoch": state.epoch}
                async with self.session.get(f"{state.url}/v1/kv-events", params=params, timeout=timeout) as response:
                    body = await response.json() if response.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, OSError, json.JSONDecodeError):
                body = None
            if body is None:
                self._down(state)
            else:
                self._update(state, body)
            await asyncio.sleep(self.config.poll_interval_s)

    def _update(self, state: ReplicaState, body: dict) -> None:
        if body.get("hash_scheme") != HASH_SCHEME:
            if state.ready or not state.epoch:
                log.error("replica %s hashes blocks as %r, not %r: not routed to", state.url,
                          body.get("hash_scheme"), HASH_SCHEME)  # fmt: skip
            self._down(state)
            state.epoch = "?"
            return
        self.picker.index.apply(state.url, body["events"], body["reset"])
        if body["reset"] and state.epoch and state.epoch != body["epoch"]:
            self.picker.approx.drop(state.url)  # a new engine holds nothing the router sent the old one
        state.epoch, state.next_seq, state.block_size = body["epoch"], body["next_seq"], body["block_size"]
        state.load = body["load"]
        state.draining = bool(body.get("draining"))
        if body.get("ready") and not state.ready:
            log.info("replica %s is ready", state.url)
        state.ready = bool(body.get("ready"))

    def _down(self, state: ReplicaState) -> None:
        if state.ready:
            log.warning("replica %s is down; not routed to until it answers again", state.url)
        state.ready = False
        state.next_seq, state.epoch = 0, ""  # the next good poll brings a snapshot
        self.picker.index.drop(state.url)

    async def _load_tokenizer(self) -> None:
        from overlap.sidecar.text import TextProcessor, tokenizer_folder

        loop = asyncio.get_running_loop()
        if self.config.tokenizer:
            self.text = await loop.run_in_executor(None, TextProcessor, self.config.tokenizer)
            return
        while self.text is None:
            for state in self.candidates():
                try:
                    async with self.session.get(f"{state.url}/v1/tokenizer") as response:
                        if response.status != 200:
                            continue
                        files = {k: base64.b64decode(v) for k, v in (await response.json())["files"].items()}
                    self.text = await loop.run_in_executor(None, TextProcessor, tokenizer_folder(files))
                    log.info("tokenizer loaded from %s", state.url)
                    return
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as exc:
                    log.warning("cannot load the tokenizer from %s: %s", state.url, exc)
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------------------------------------ requests
    async def prompt_tokens_of(self, path: str, body: dict) -> list[int]:
        """The token ids the replica will see for this request's prompt (as far as scoring needs them)."""
        if path == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # several prompts: score by the first
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, str) and self.text is not None:
                return await self._off_loop(len(prompt), self.text.encode, prompt)
            return []
        messages = body.get("messages")
        if not isinstance(messages, list) or self.text is None or not self.text.has_chat_template:
            return []
        flat = [m for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
        size = sum(len(m["content"]) for m in flat)
        try:
            return await self._off_loop(size, self.text.encode_chat, flat, True, False, body.get("tools"))
        except Exception:  # a template that refuses these messages: the replica will say why
            return []

    @staticmethod
    async def _off_loop(size: int, fn, *args):
        if size > _OFF_LOOP_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes
        session = request.headers.get(self.config.session_header)
        tokens: list[int] = []
        if request.method == "POST" and request.path in SCORED_PATHS and self.config.policy in ("prefix", "approx"):
            started = time.perf_counter()
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                body = json.loads(raw)
                if isinstance(body, dict):
                    tokens = await self.prompt_tokens_of(request.path, body)
            self.tokenize_time.observe(time.perf_counter() - started)
        tried: set[str] = set()
        for attempt in range(self.config.max_attempts):
            candidates = [r for r in self.candidates() if r.url not in tried]
            if not candidates:
                break
            started = time.perf_counter()
            size = candidates[0].block_size or 16
            if size not in hashes:
                hashes[size] = block_hashes(tokens, size)
            pick = self.picker.pick(candidates, hashes[size], size, len(tokens), session)
            self.pick_time.observe(time.perf_counter() - started)
            if attempt:
                self.retries.inc()
            tried.add(pick.replica.url)
            response = await self._forward(request, raw, pick.replica, self.picker.uncached(pick, size, len(tokens)))
            if response is None:  # refused before anything was sent to the client: try the next best
                continue
            self.picks.labels(pick.reason).inc()
            self.picker.routed(pick, hashes[size], size, len(tokens), session)
            if tokens:
                self.prompt_tokens.inc(len(tokens))
                self.hit_tokens.inc(min(pick.hit_blocks * size, len(tokens)))
            return response
        self.failed.inc()
        body = {"error": {"message": "no replica could take the request; retry shortly", "type": "service_unavailable",
                          "code": "no_ready_replica"}}  # fmt: skip
        return web.json_response(body, status=503, headers={"Retry-After": "1"})

    async def _forward(self, request: web.Request, raw: bytes, replica: ReplicaState,
                       uncached: int) -> web.StreamResponse | None:  # fmt: skip
        """Relay to `replica`; None when it refused before the client got anything (connection, 5xx, 429).
        `uncached` prompt tokens count in its backlog until its answer starts."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        replica.in_flight += 1
        replica.starting += 1
        replica.backlog_tokens += uncached
        before_first_byte = True

        def streaming() -> None:
            nonlocal before_first_byte
            if before_first_byte:
                before_first_byte = False
                replica.starting -= 1
                replica.backlog_tokens -= uncached

        try:
            try:
                upstream = await self.session.request(request.method, f"{replica.url}{request.rel_url}",
                                                      headers=headers, data=raw or None)  # fmt: skip
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("replica %s failed a request before answering: %s", replica.url, exc)
                self._down(replica)
                return None
            try:
                if upstream.status >= 500 or upstream.status == 429:
                    if upstream.status != 429:
                        self._down(replica)
                    return None
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP},
                )
                await response.prepare(request)
                # a replica lost mid-stream: the client sees the end of what it sent
                with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                    async for chunk in upstream.content.iter_any():
                        streaming()
                        await response.write(chunk)
                await response.write_eof()
                return response
            finally:
                upstream.release()
        finally:
            streaming()
            replica.in_flight -= 1

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.candidates()
        body = {"ready": bool(ready), "replicas": {r.url: {"ready": r.ready, "draining": r.draining, "queue": r.queue}
                                                   for r in self.replicas.values()}}  # fmt: skip
        return web.json_response(body, status=200 if ready else 503)


def build_app(config: RouterConfig, registry: CollectorRegistry | None = None) -> web.Application:
    router = Router(config, registry)
    app = web.Application(client_max_size=config.max_body_bytes)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/readyz", router.readyz)
    app.router.add_get("/router/readyz", router.readyz)
    app.router.add_get("/metrics", metrics_handler(router.registry))
    app.router.add_route("*", "/{tail:.*}", router.handle)
    app["router"] = router
    return app


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route requests across replicas by their cached prefixes and load (OpenAI API in front of sidecars)",
        description=__doc__.splitlines()[0],
    )
    defaults = RouterConfig(replicas=["http://placeholder"])
    parser.add_argument("--replica", action="append", required=True, dest="replicas", metavar="URL",
                        help="a replica's sidecar (http://HOST:PORT); repeat for each")  # fmt: skip
    parser.add_argument("--policy", default=defaults.policy, choices=POLICIES,
                        help="prefix (engine KV events, default), approx (router-side tracking), least-queue, "
                             "round-robin, random")  # fmt: skip
    parser.add_argument("--host", default=defaults.host, help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="listen port (default %(default)d)")
    parser.add_argument("--poll-interval-s", type=float, default=defaults.poll_interval_s,
                        help="how often each replica's /v1/kv-events is read (default %(default)g)")  # fmt: skip
    parser.add_argument("--session-header", default=defaults.session_header,
                        help="header naming a session to keep on one replica (default %(default)s)")  # fmt: skip
    parser.add_argument("--tokenizer", help="the model's tokenizer folder (default: fetched from a replica)")
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts,
                        help="replicas tried per request before a 503 (default %(default)d)")  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    config = RouterConfig(replicas=args.replicas, policy=args.policy, host=args.host, port=args.port,
                          poll_interval_s=args.poll_interval_s, session_header=args.session_header,
                          tokenizer=args.tokenizer, max_attempts=args.max_attempts)  # fmt: skip
    log.info("router on %s:%d, policy %s, replicas %s", config.host, config.port, config.policy, config.replicas)
    web.run_app(build_app(config), host=config.host, port=config.port, print=None, handle_signals=True)
    return 0
