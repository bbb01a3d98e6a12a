"""The admin port: read and apply the engine's live configuration, and list, load and unload LoRA adapters (bearer
token, never on the public Service), and the file-watch mode that applies a mounted ConfigMap file when it
changes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from aiohttp import web

from overlap.engine.config import LiveKnobs
from overlap.engine.errors import ConfigError
from overlap.engine.serving.client import EngineUnavailable
from overlap.openai.auth import bearer_matches
from overlap.sidecar.http import json_response, read_body
from overlap.sidecar.middlewares import error_middleware
from overlap.sidecar.openai import lora
from overlap.sidecar.state import STATE, ApiError, ServerState, engine_unavailable

log = logging.getLogger(__name__)


class AdminToken:
    """The admin bearer token. From a file (a mounted Secret) it follows the file: kubelet rewrites the mount when
    the Secret changes, so deleting the Secret (the operator makes a new token) rotates the token of running pods
    too. A rewrite that leaves the file empty or unreadable keeps the last good token."""

    def __init__(self, token: str, file: str | None = None) -> None:
        self._token, self._file = token, file
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        if not self._file:
            return None
        try:
            stat = Path(self._file).stat()  # through kubelet's ..data symlink: a new inode when it swaps
        except OSError:
            return None
        return (stat.st_ino, stat.st_mtime_ns)

    def current(self) -> str:
        stamp = self._stamp()
        if stamp is not None and stamp != self._seen:
            self._seen = stamp
            try:
                token = Path(self._file).read_text().strip()
            except OSError as exc:
                log.warning("admin token file %s unreadable, keeping the last token: %s", self._file, exc)
                return self._token
            if len(token) >= 8:
                if token != self._token:
                    log.info("admin token rotated (%s changed)", self._file)
                self._token = token
            else:
                log.warning("admin token file %s holds no usable token, keeping the last one", self._file)
        return self._token


ADMIN_TOKEN = web.AppKey("admin_token", AdminToken)


@web.middleware
async def bearer_auth(request: web.Request, handler):
    if not bearer_matches(request.headers.get("Authorization", ""), request.app[ADMIN_TOKEN].current()):
        raise ApiError(401, "a valid admin bearer token is required", "authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
    return await handler(request)


async def get_config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        stats = await state.client.stats()
    except EngineUnavailable as exc:
        raise engine_unavailable() from exc
    return json_response({"config": stats.get("config", {}), "live_knobs": list(LiveKnobs.names())})


async def put_config(request: web.Request) -> web.Response:
    """Any of the live knobs (LiveKnobs' names); the others keep the values the engine runs."""
    state = request.app[STATE]
    patch = await read_body(request, dict)
    if not patch:
        raise ApiError(400, f"nothing to apply: send some of {', '.join(LiveKnobs.names())}")
    try:
        config = (await state.client.stats())["config"]
        knobs = await state.client.reconfigure(LiveKnobs.of(config).replace(**patch))
    except ConfigError as exc:
        raise ApiError(400, f"not applied: {exc}") from exc
    except EngineUnavailable as exc:
        raise engine_unavailable() from exc
    log.info("live config applied through the admin API: %s", patch)
    applied = knobs.to_dict()
    return json_response({"applied": {k: applied[k] for k in patch}, "config": {**config, **applied}})


async def get_lora(request: web.Request) -> web.Response:
    """The LoRA adapters the engine serves: {name: folder}."""
    return json_response({"adapters": dict(request.app[STATE].lora_adapters)})


def init_admin_app(state: ServerState, token: str, token_file: str | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware, bearer_auth], client_max_size=64 * 1024)
    app[STATE] = state
    app[ADMIN_TOKEN] = AdminToken(token, token_file)
    app.router.add_get("/admin/config", get_config)
    app.router.add_put("/admin/config", put_config)
    app.router.add_get("/admin/lora", get_lora)
    app.router.add_post("/admin/lora/load", lora.load)
    app.router.add_post("/admin/lora/unload", lora.unload)
    return app


async def watch_config_file(state: ServerState, path: Path, interval_s: float) -> None:
    """Apply the live knobs of `path` whenever its content changes (a ConfigMap update swaps the file).

    The content found at start-up is the baseline, not a change: the engine read the same file when it started, and
    flags given on its command line (`overlap serve --max-num-seqs 128 --config f.yaml`) must keep winning over it
    until the file is edited."""
    from overlap.engine.serving.server import read_config_file

    try:
        applied_digest: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        applied_digest = None  # not mounted yet: its first content counts as a change
    while True:
        await asyncio.sleep(interval_s)
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue  # not mounted yet, or mid-swap
        if digest == applied_digest or not state.client.connected:
            continue
        try:
            fields = read_config_file(path)
            current = (await state.client.stats()).get("config", {})
            running = LiveKnobs.of(current)
            knobs = running.replace(**{k: v for k, v in fields.items() if k in LiveKnobs.names()})
            restart_only = sorted(k for k, v in fields.items() if k not in LiveKnobs.names() and current.get(k) != v)
            if knobs != running:
                await state.client.reconfigure(knobs)
                log.info("applied live config from %s: %s", path, knobs)
            if restart_only:
                log.warning("%s changes %s, which take effect only when the engine restarts", path, restart_only)
            applied_digest = digest
        except ConfigError as exc:
            log.error("config file %s not applied: %s", path, exc)
            applied_digest = digest  # retry only when the file changes again
        except EngineUnavailable:
            pass  # retried at the next tick
