"""The sidecar's aiohttp application: `init_app(config)` + `setup_routes` + `setup_middlewares`, the engine client
and background tasks in `cleanup_ctx`, and `serve()` that runs the public and admin ports until SIGTERM drains."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from overlap.engine.serving import protocol as p
from overlap.engine.serving.client import EngineClient, EngineUnavailable
from overlap.openai.text import TextProcessor, tokenizer_folder
from overlap.sidecar.admin import init_admin_app, watch_config_file
from overlap.sidecar.admission import Admission
from overlap.sidecar.config import SidecarConfig
from overlap.sidecar.http import json_response, metrics_handler
from overlap.sidecar.metrics import EngineCollector, SidecarMetrics
from overlap.sidecar.middlewares import api_key_auth, error_middleware
from overlap.sidecar.openai import ROUTES
from overlap.sidecar.openapi import openapi_document
from overlap.sidecar.state import STATE, ServerState

log = logging.getLogger(__name__)

# After our own grace period, how long aiohttp waits for a handler before cancelling it (its default is 60 s,
# which would stretch a SIGTERM well past the grace period the pod was given).
_HANDLER_CANCEL_WAIT_S = 1.0
_TASK_STOP_WAIT_S = 2.0  # how long shutdown waits for the engine client's background tasks after cancelling them


def init_app(config: SidecarConfig, registry: CollectorRegistry | None = None) -> web.Application:
    registry = registry if registry is not None else CollectorRegistry()
    admission = Admission(config.max_queued_requests, config.max_queued_tokens, config.max_inflight)
    state = ServerState(
        config=config,
        registry=registry,
        metrics=SidecarMetrics(registry),
        admission=admission,
        # `state` is looked up when the engine says hello, after this assignment.
        client=EngineClient(config.engine_socket, on_hello=lambda hello: _on_engine_hello(state, hello)),
    )
    registry.register(
        EngineCollector(
            lambda: state.client.latest_stats if state.client.connected else None,
            lambda: {"queued": admission.num_queued, "inflight": admission.num_inflight},
        )
    )
    app = web.Application(client_max_size=config.max_body_bytes)
    app[STATE] = state
    setup_routes(app)
    setup_middlewares(app)
    app.cleanup_ctx.append(_engine_ctx)
    return app


def setup_routes(app: web.Application) -> None:
    state = app[STATE]
    for method, path, _, handler, _ in ROUTES:
        app.router.add_route(method, path, handler)
    app.router.add_get("/metrics", metrics_handler(state.registry))
    document = openapi_document(
        [(m, path, summary, body) for m, path, summary, _, body in ROUTES]
        + [("GET", "/metrics", "Prometheus metrics", None), ("GET", "/openapi.json", "This document", None)]
    )

    async def openapi(request: web.Request) -> web.Response:
        return json_response(document)

    app.router.add_get("/openapi.json", openapi)


def setup_middlewares(app: web.Application) -> None:
    app.middlewares.append(error_middleware)
    if app[STATE].config.api_key:
        app.middlewares.append(api_key_auth)


async def _on_engine_hello(state: ServerState, hello: p.Hello) -> None:
    """Load the tokenizer from the engine's model folder (once, or again when the model changed)."""
    source = state.config.tokenizer or _tokenizer_source(hello)
    if state.text is None or state.text.model_dir != source:
        started = time.monotonic()
        preload, state.text_preload = state.text_preload, None
        try:
            if preload is not None and source == state.config.tokenizer:
                state.text = await preload  # started with the sidecar, while the engine loaded its model
            else:
                state.text = await asyncio.get_running_loop().run_in_executor(None, TextProcessor, source)
        except Exception as exc:
            log.error("cannot load the tokenizer from %s: %s (pass --tokenizer DIR)", source, exc)
            await asyncio.sleep(5)  # then reconnect and try again, without hammering the engine
            raise p.ProtocolError(f"no tokenizer: {exc}") from exc
        log.info("tokenizer from %s ready (%.1f s after the engine's hello)", source, time.monotonic() - started)
    state.max_model_len = hello.max_model_len
    state.vocab_size = hello.vocab_size
    state.num_priority_levels = max(1, hello.num_priority_levels)
    state.model_name = state.config.served_model_name or hello.model_name
    state.sampling_defaults = dict(hello.sampling_defaults)
    state.quantization = hello.quantization
    state.lora_adapters = dict(hello.lora_adapters)


def _tokenizer_source(hello: p.Hello) -> str:
    """The engine's model folder when this container sees it too; else the tokenizer files the engine sent."""
    if (Path(hello.model_dir) / "tokenizer_config.json").is_file() or not hello.tokenizer_files:
        return hello.model_dir
    return tokenizer_folder(hello.tokenizer_files)


async def _poll_stats(state: ServerState) -> None:
    while True:
        await asyncio.sleep(state.config.stats_interval_s)
        if state.client.connected:
            with contextlib.suppress(EngineUnavailable):
                await state.client.stats()


async def _engine_ctx(app: web.Application):
    state = app[STATE]
    if state.config.tokenizer:  # known up front: load it while the engine is still starting
        state.text_preload = asyncio.get_running_loop().run_in_executor(None, TextProcessor, state.config.tokenizer)
    tasks = [asyncio.create_task(state.client.run(), name="engine-client")]
    tasks.append(asyncio.create_task(_poll_stats(state), name="engine-stats"))
    if state.config.watch_config:
        watcher = watch_config_file(state, Path(state.config.watch_config), state.config.watch_interval_s)
        tasks.append(asyncio.create_task(watcher, name="config-watch"))
    yield
    for task in tasks:
        task.cancel()
    # Bounded: a task that swallowed its cancel must not hold the sidecar past its shutdown.
    _, still_running = await asyncio.wait(tasks, timeout=_TASK_STOP_WAIT_S)
    for task in still_running:
        log.error("background task %s did not stop within %g s of its cancel; leaving it", task.get_name(),
                  _TASK_STOP_WAIT_S)  # fmt: skip


async def serve(config: SidecarConfig, registry: CollectorRegistry | None = None) -> None:
    """Run the public (and admin) port until SIGTERM/SIGINT, then drain: readiness false, new requests 503,
    in-flight requests get up to `grace_period_s` to finish; the rest are aborted."""
    app = init_app(config, registry)
    state = app[STATE]
    runner_args = {"handler_cancellation": True, "access_log": None, "shutdown_timeout": _HANDLER_CANCEL_WAIT_S,
                   "keepalive_timeout": config.idle_timeout_s}  # fmt: skip
    runners = [web.AppRunner(app, **runner_args)]
    await runners[0].setup()
    await web.TCPSite(runners[0], config.host, config.port).start()
    log.info("sidecar listening on http://%s:%d", config.host, config.port)
    if config.admin_port is not None:
        admin = web.AppRunner(init_admin_app(state, config.admin_token, config.admin_token_file), **runner_args)
        await admin.setup()
        await web.TCPSite(admin, config.admin_host, config.admin_port).start()
        runners.append(admin)
        log.info("admin API on http://%s:%d/admin/config", config.admin_host, config.admin_port)

    alive = Path(config.alive_file) if config.alive_file else None
    if alive is not None:
        alive.write_text(f"{os.getpid()}\n")
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()

        state.draining = True
        deadline = time.monotonic() + config.grace_period_s
        log.info("draining: %d requests in flight, up to %.0f s", state.admission.num_inflight, config.grace_period_s)
        while state.admission.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.admission.num_inflight:
            log.warning("grace period over: aborting %d requests", state.admission.num_inflight)
        for runner in reversed(runners):
            await runner.cleanup()
    finally:
        if alive is not None:
            alive.unlink(missing_ok=True)
    log.info("sidecar stopped")
