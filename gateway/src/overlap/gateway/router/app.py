"""`overlap router`: one address for several replicas, each request sent where its prompt's KV is cached and the queue
is short (`picker.py` says how it scores).

- Replicas: `--replica URL` (a sidecar's public port), or `--replicas-from HOST:PORT`, a DNS name whose addresses
  are the replicas (a headless Service: its ready pods), looked up again every `--resolve-interval-s`; a replica
  whose address went is dropped at once. Each is polled every `--poll-interval-s` at `/v1/kv-events`:
  the blocks its prefix cache added and evicted since the last poll (a snapshot first and after an engine restart),
  its load (waiting, running, KV usage, the sidecar's admission queue) and whether it is ready or draining. The
  block size and hash scheme come from there too, so nothing is configured twice. `/v1/models` is read in the
  same poll (the same failure rule): the LoRA adapters the replica serves. One failed poll (a timeout on a
  loaded machine) changes nothing; the second in a row marks the replica down and drops its blocks from the index.
- A request: its prompt tokenized once here (the model's tokenizer: `--tokenizer DIR`, else the files a replica
  serves at `/v1/tokenizer`), hashed into blocks (through the LoRA adapter its `model` names), a replica picked,
  the request relayed as it came (streams chunk by chunk). A replica that refuses the connection, answers 5xx or
  429 before a byte went to the client is marked down (until its next good poll) and the request goes to the next
  best: nothing accepted is lost while another replica is up. One that fails mid-stream cannot be retried (the
  client has part of the answer).
- No replica ready (none yet, scaled to zero, all failing): a request is held up to `--hold-timeout-s` (at most
  `--max-held` at once) until one is, then sent; `overlap_router_held_requests` counts them, which the operator's
  control loop reads to scale from zero. The router is the scale-from-zero activator of a routed service.
- `/router/healthz`: 200 while the router runs (its pod's probes: it must take requests to hold them). `/readyz`:
  200 while some replica is ready. `/v1/models`: the models the ready replicas serve (the base and every adapter).
  `/metrics`: picks by reason, adapter requests by whether the replica had the adapter loaded, prompt and
  prefix-hit tokens, the index size, pick and tokenize latency, retries, held requests, ready replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import socket
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from overlap.engine.errors import ConfigError
from overlap.engine.prefix_hash import HASH_SCHEME, Adapter, block_hashes
from overlap.gateway.proxy import (
    UPSTREAM_ERRORS,
    HoldingProxy,
    add_listen_flags,
    api_key_from_env,
    check_key_and_urls,
    end_to_end,
    relay,
    run,
)
from overlap.gateway.router.picker import POLICIES, Picker, ReplicaState
from overlap.openai import schemas, tools  # a chat request scored on the tokens the sidecar renders from it

log = logging.getLogger("overlap.router")
SCORED_PATHS = ("/v1/completions", "/v1/chat/completions")
_OFF_LOOP_CHARS = 4096  # longer prompts are tokenized on a worker thread, so the loop keeps picking
DOWN_AFTER_FAILED_POLLS = 2  # consecutive failed KV-event polls that mark a replica down and drop its index


@dataclass(slots=True)
class RouterConfig:
    replicas: list[str] = field(default_factory=list)
    replicas_from: str | None = None  # HOST:PORT, every address of HOST a replica
    policy: str = "prefix"
    host: str = "0.0.0.0"
    port: int = 8000
    poll_interval_s: float = 0.05
    session_header: str = "x-session-id"
    tokenizer: str | None = None
    max_attempts: int = 3
    resolve_interval_s: float = 1.0
    hold_timeout_s: float = 30.0
    max_held: int = 1000
    max_body_bytes: int = 16 * 1024 * 1024
    api_key: str | None = None  # required of clients on /v1/*, sent to the pods (`proxy.HoldingProxy`)

    def __post_init__(self) -> None:
        if bool(self.replicas) == bool(self.replicas_from):
            raise ConfigError("the router needs --replica URL (repeated) or --replicas-from HOST:PORT, not both")
        if self.replicas_from is not None:
            host, _, port = self.replicas_from.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--replicas-from must be HOST:PORT, got {self.replicas_from!r}")
        bad = [r for r in self.replicas if not r.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"--replica must be an http(s) URL, got {bad[0]!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if min(self.poll_interval_s, self.resolve_interval_s) <= 0 or self.hold_timeout_s < 0:
            raise ConfigError("--poll-interval-s and --resolve-interval-s must be positive, --hold-timeout-s >= 0")
        if self.max_attempts < 1 or self.max_held < 1:
            raise ConfigError("--max-attempts and --max-held must be at least 1")
        self.replicas = [r.rstrip("/") for r in self.replicas]
        check_key_and_urls(self.api_key, self.replicas)


class Router(HoldingProxy):
    """`ready` is set while a replica is ready and not draining."""

    def __init__(self, config: RouterConfig, registry: CollectorRegistry | None = None) -> None:
        super().__init__(config, registry)
        self.replicas: dict[str, ReplicaState] = {}
        self.picker = Picker(config.policy)
        self.text = None  # TextProcessor, once loaded
        self._polls: dict[str, asyncio.Task] = {}
        r = self.registry
        self.picks = Counter("overlap_router_picks", "Requests routed, by why the replica won", ["reason"], registry=r)
        self.prompt_tokens = Counter("overlap_router_prompt_tokens", "Prompt tokens of scored requests", registry=r)
        self.hit_tokens = Counter(
            "overlap_router_prefix_hit_tokens", "Prompt tokens the picked replica had cached", registry=r
        )
        self.retries = Counter("overlap_router_retries", "Requests sent again to another replica", registry=r)
        self.failed = Counter("overlap_router_failed_requests", "Requests no replica could take", registry=r)
        self.adapter_picks = Counter("overlap_router_adapter_requests", "Requests for a LoRA adapter, by whether the "
                                     "replica picked had it loaded", ["loaded"], registry=r)  # fmt: skip
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
        Gauge("overlap_router_held_requests", "Requests held while no replica is ready", registry=r).set_function(
            lambda: self.waiting.count
        )

    # ------------------------------------------------------------------------------------------------ lifecycle
    def routes(self) -> dict[str, object]:
        return {"/readyz": self.readyz, "/router/readyz": self.readyz, "/router/healthz": self.healthz,
                "/metrics": self.metrics, "/v1/models": self.list_models}  # fmt: skip

    def background(self) -> list:
        return [self._resolve(), self._load_tokenizer()] if self.config.replicas_from else [self._load_tokenizer()]

    async def start(self, app: web.Application) -> None:
        await super().start(app)
        if not self.config.replicas_from:
            self._set_replicas(self.config.replicas)

    async def stop(self, app: web.Application) -> None:
        self.tasks.extend(self._polls.values())
        await super().stop(app)

    def candidates(self) -> list[ReplicaState]:
        return [r for r in self.replicas.values() if r.ready and not r.draining]

    def _set_replicas(self, urls: list[str]) -> None:
        """Poll the replicas in `urls` from now on, and forget the others (their requests in flight go on)."""
        for url in urls:
            if url not in self.replicas:
                log.info("replica %s added", url)
                self.replicas[url] = state = ReplicaState(url)
                self._polls[url] = asyncio.create_task(self._poll(state))
        for url in [u for u in self.replicas if u not in urls]:
            log.info("replica %s removed (no longer among the addresses of %s)", url, self.config.replicas_from)
            self._polls.pop(url).cancel()
            del self.replicas[url]
            self.picker.index.drop(url)
            self.picker.approx.drop(url)
        self._readiness_changed()

    async def _resolve(self) -> None:
        """The replicas are the addresses of --replicas-from's name (a headless Service answers with its ready
        pods), looked up again every --resolve-interval-s."""
        host, _, port = self.config.replicas_from.rpartition(":")
        loop = asyncio.get_running_loop()
        while True:
            try:
                found = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                addresses = sorted({info[4][0] for info in found})
            except socket.gaierror as exc:
                # no such name: a headless Service with no ready pod; any other failure keeps what we have
                addresses = [] if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)) else None
                if addresses is None:
                    log.warning("cannot resolve %s: %s", host, exc)
            if addresses is not None:
                self._set_replicas([f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addresses])
            await asyncio.sleep(self.config.resolve_interval_s)

    def _readiness_changed(self) -> None:
        if self.candidates():
            self.ready.set()
        else:
            self.ready.clear()

    async def _poll(self, state: ReplicaState) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, 10 * self.config.poll_interval_s))
        while True:
            params = {"since": str(state.next_seq), "epoch": state.epoch}
            body, models = await asyncio.gather(self._get_json(f"{state.url}/v1/kv-events", params, timeout),
                                                self._get_json(f"{state.url}/v1/models", None, timeout))  # fmt: skip
            self._polled(state, body if isinstance(models, dict) else None, models)
            await asyncio.sleep(self.config.poll_interval_s)

    async def _get_json(self, url: str, params: dict | None, timeout: aiohttp.ClientTimeout):
        try:
            async with self.session.get(url, params=params, timeout=timeout) as response:
                return await response.json() if response.status == 200 else None
        except (*UPSTREAM_ERRORS, json.JSONDecodeError):
            return None

    def _polled(self, state: ReplicaState, body: dict | None, models: dict | None = None) -> None:
        """A poll's answer: its KV events (`body`) and its /v1/models (`models`), body None when either failed (no
        connection, a timeout, not 200). One failed poll changes nothing:
        on a loaded machine a live replica's poll can time out, and dropping its blocks would send its prefixes
        elsewhere. The second in a row marks it down (its index dropped until a good poll brings a snapshot)."""
        if body is not None:
            state.failed_polls = 0
            if models is not None:
                state.set_models(models.get("data") or [])
            self._update(state, body)
            return
        state.failed_polls += 1
        if state.failed_polls >= DOWN_AFTER_FAILED_POLLS:
            self._down(state)
        elif state.ready:
            log.info("replica %s missed a poll; still routed to until the next one fails too", state.url)

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
        self._readiness_changed()

    def _down(self, state: ReplicaState) -> None:
        if state.ready:
            log.warning("replica %s is down; not routed to until it answers again", state.url)
        state.ready = False
        state.next_seq, state.epoch = 0, ""  # the next good poll brings a snapshot
        state.set_models([])
        self.picker.index.drop(state.url)
        self._readiness_changed()

    async def _load_tokenizer(self) -> None:
        from overlap.openai.text import TextProcessor, tokenizer_folder  # the sidecar's tokenizer: the same tokens

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
        if self.text is None or not self.text.has_chat_template:
            return []
        try:  # the messages and tools as the sidecar hands them to the chat template
            chat = msgspec.convert(body, schemas.ChatCompletionRequest)
            messages = schemas.chat_messages_as_dicts(chat.messages)
            shown = tools.setup(chat.tools, chat.tool_choice, None, chat.parallel_tool_calls)
        except (msgspec.ValidationError, ValueError):
            return []  # a request the replica will refuse, saying why
        size = sum(len(m["content"]) for m in messages)
        try:
            return await self._off_loop(size, self.text.encode_chat, messages, True, False,
                                        shown.tools_for_template if shown is not None else None)  # fmt: skip
        except Exception:  # a template that refuses these messages: the replica will say why
            return []

    @staticmethod
    async def _off_loop(size: int, fn, *args):
        if size > _OFF_LOOP_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        deadline = time.monotonic() + self.config.hold_timeout_s
        raw = await request.read()
        body = self._json_body(request, raw)
        model = body.get("model") if body is not None else None
        model = model if isinstance(model, str) else None
        hashes: dict[tuple[int, Adapter | None], list[int]] = {}  # (block size, adapter) -> the prompt's hashes
        session = request.headers.get(self.config.session_header)
        tokens: list[int] | None = None  # tokenized at the first pick: a held request may wait for the tokenizer
        tried: set[str] = set()
        attempt = 0
        while attempt < self.config.max_attempts:
            candidates = [r for r in self.candidates() if r.url not in tried]
            if not candidates:
                if self.candidates() or self.waiting.full() or not await self.waiting.wait(deadline):
                    break  # every ready replica refused it, or none became ready in time
                continue
            if tokens is None:
                tokens = await self._scored_tokens(request, body)
            started = time.perf_counter()
            size = candidates[0].block_size or 16
            adapter = model if any(model in r.adapters for r in self.replicas.values()) else None
            # hashed through the adapter as the replicas that serve it load it (its KV is the folder's)
            folder = next((r.adapter_folders[adapter] for r in candidates if adapter in r.adapters), None)
            key = (size, None if adapter is None else (adapter, folder or ""))
            if key not in hashes:
                hashes[key] = block_hashes(tokens, size, key[1])
            pick = self.picker.pick(candidates, hashes[key], size, len(tokens), session, adapter)
            self.pick_time.observe(time.perf_counter() - started)
            if attempt:
                self.retries.inc()
            attempt += 1
            tried.add(pick.replica.url)
            uncached = self.picker.uncached(pick, size, len(tokens))
            response = await self._forward(request, raw, pick.replica, uncached, adapter)
            if response is None:  # refused before anything was sent to the client: try the next best
                continue
            self.picks.labels(pick.reason).inc()
            if adapter is not None:
                self.adapter_picks.labels(str(pick.adapter_loaded).lower()).inc()
            self.picker.routed(pick, hashes[key], size, len(tokens), session, adapter)
            if tokens:
                self.prompt_tokens.inc(len(tokens))
                self.hit_tokens.inc(min(pick.hit_blocks * size, len(tokens)))
            return response
        self.failed.inc()
        if attempt:
            message = f"{attempt} replicas refused the request; retry shortly"
        else:
            message = f"no replica became ready within {self.config.hold_timeout_s:g} s; retry shortly"
        body = {"error": {"message": message, "type": "service_unavailable", "code": "no_ready_replica"}}
        return web.json_response(body, status=503, headers={"Retry-After": "1"})

    @staticmethod
    def _json_body(request: web.Request, raw: bytes) -> dict | None:
        """A completion or chat request's body (None for anything else, or what is no JSON object)."""
        if request.method != "POST" or request.path not in SCORED_PATHS:
            return None
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            body = json.loads(raw)
            return body if isinstance(body, dict) else None
        return None

    async def _scored_tokens(self, request: web.Request, body: dict | None) -> list[int]:
        if body is None or self.config.policy not in ("prefix", "approx"):
            return []
        started = time.perf_counter()
        tokens = await self.prompt_tokens_of(request.path, body)
        self.tokenize_time.observe(time.perf_counter() - started)
        return tokens

    async def _forward(self, request: web.Request, raw: bytes, replica: ReplicaState, uncached: int,
                       adapter: str | None) -> web.StreamResponse | None:  # fmt: skip
        """Relay to `replica`; None when it refused before the client got anything (connection, 5xx, 429, or a 404
        for LoRA `adapter`: unloaded there since its last poll, which it is then taken off until the next).
        `uncached` prompt tokens count in its backlog until its answer starts; `adapter` is loaded there while the
        request runs."""
        replica.in_flight += 1
        if adapter is not None:
            replica.adapter_requests[adapter] = replica.adapter_requests.get(adapter, 0) + 1
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
                url = f"{replica.url}{request.rel_url}"
                upstream = await self.session.request(request.method, url, headers=end_to_end(request.headers),
                                                      data=raw or None)  # fmt: skip
            except UPSTREAM_ERRORS as exc:
                log.warning("replica %s failed a request before answering: %s", replica.url, exc)
                self._down(replica)
                return None
            try:
                if upstream.status >= 500 or upstream.status == 429:
                    if upstream.status != 429:
                        self._down(replica)
                    return None
                if upstream.status == 404 and adapter is not None:
                    body = await upstream.read()
                    if b'"model_not_found"' in body:  # the sidecar's code for an adapter it does not serve
                        log.info("replica %s no longer serves adapter %r", replica.url, adapter)
                        replica.adapters -= {adapter}
                        return None
                    return web.Response(body=body, status=404, content_type=upstream.content_type)
                # a replica lost mid-stream: the client sees the end of what it sent
                return await relay(request, upstream, on_chunk=streaming, keep_partial=True)
            finally:
                upstream.release()
        finally:
            streaming()
            replica.in_flight -= 1
            if adapter is not None:
                replica.adapter_requests[adapter] -= 1
                if not replica.adapter_requests[adapter]:
                    del replica.adapter_requests[adapter]

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        """The models the ready replicas serve: the base model, then every LoRA adapter any of them serves (a request
        for one goes to a replica that serves it). Relayed as any request while no replica has answered a poll."""
        served: dict[str, dict] = {}
        for replica in self.candidates():
            for model in replica.models:
                served.setdefault(model["id"], model)
        if not served:
            return await self.handle(request)
        ordered = sorted(served.values(), key=lambda m: (bool(m.get("parent")), m["id"]))
        return web.json_response({"object": "list", "data": ordered})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"held": self.waiting.count, "replicas": len(self.replicas),
                                  "ready_replicas": len(self.candidates())})  # fmt: skip

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.candidates()
        body = {"ready": bool(ready), "replicas": {r.url: {"ready": r.ready, "draining": r.draining, "queue": r.queue}
                                                   for r in self.replicas.values()}}  # fmt: skip
        return web.json_response(body, status=200 if ready else 503)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route requests across replicas by their cached prefixes, LoRA adapters and load (OpenAI API in front "
        "of sidecars)",
        description=__doc__.splitlines()[0],
    )
    defaults = RouterConfig(replicas=["http://placeholder"])
    replicas = parser.add_mutually_exclusive_group(required=True)
    replicas.add_argument("--replica", action="append", dest="replicas", metavar="URL",
                          help="a replica's sidecar (http://HOST:PORT); repeat for each")  # fmt: skip
    replicas.add_argument("--replicas-from", metavar="HOST:PORT",
                          help="a DNS name whose addresses are the replicas (a headless Service), looked up again "
                               "every --resolve-interval-s")  # fmt: skip
    parser.add_argument("--policy", default=defaults.policy, choices=POLICIES,
                        help="prefix (engine KV events, default), approx (router-side tracking), least-queue, "
                             "round-robin, random")  # fmt: skip
    add_listen_flags(parser, defaults)
    parser.add_argument("--poll-interval-s", type=float, default=defaults.poll_interval_s,
                        help="how often each replica's /v1/kv-events is read (default %(default)g)")  # fmt: skip
    parser.add_argument("--session-header", default=defaults.session_header,
                        help="header naming a session to keep on one replica (default %(default)s)")  # fmt: skip
    parser.add_argument("--tokenizer", help="the model's tokenizer folder (default: fetched from a replica)")
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts,
                        help="replicas tried per request before a 503 (default %(default)d)")  # fmt: skip
    parser.add_argument("--resolve-interval-s", type=float, default=defaults.resolve_interval_s,
                        help="how often --replicas-from is looked up (default %(default)g)")  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    config = RouterConfig(replicas=args.replicas or [], replicas_from=args.replicas_from, policy=args.policy,
                          host=args.host, port=args.port, poll_interval_s=args.poll_interval_s,
                          session_header=args.session_header, tokenizer=args.tokenizer,
                          max_attempts=args.max_attempts, resolve_interval_s=args.resolve_interval_s,
                          hold_timeout_s=args.hold_timeout_s, max_held=args.max_held,
                          api_key=api_key_from_env(args.api_key_env))  # fmt: skip
    replicas = config.replicas or f"the addresses of {config.replicas_from}"
    return run(Router(config), log, f"policy {config.policy}, replicas {replicas}")
