"""The proxy-and-hold base of the router and the activator.

Each is a `HoldingProxy`: an aiohttp app that accepts every request, holds it in a `WaitingRoom` while no upstream
is ready (`ready` unset: a service scaled to zero, a replica set with none ready), and relays it as it came once one
is. Relaying is plain HTTP in both directions: headers and body pass through (hop-by-hop headers excepted), and a
response goes back chunk by chunk, so server-sent events stream through unchanged. What differs, where to send a
request and how to know an upstream is ready, is the subclass's `handle` and `background` tasks.

With an API key (`--api-key-env`, the pods' own key) a request to `/v1/` without it gets the sidecar's 401 here,
before it is held, and the proxy's own requests to its upstreams (the router's polls, the activator's probes) carry
it: the pods guard `/v1/` with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from overlap.engine.errors import ConfigError
from overlap.gateway.waiting import WaitingRoom
from overlap.openai.auth import UNAUTHORIZED, needs_key

# RFC 9110 section 7.6.1: connection-specific headers a proxy must not forward.
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
    "upgrade", "host", "content-length",
}  # fmt: skip
# What a request to an upstream that is gone or stuck raises (no connection, reset, timed out).
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)


def end_to_end(headers) -> dict[str, str]:
    """The headers a proxy passes on: all but the hop-by-hop ones."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


async def relay(request: web.Request, upstream: aiohttp.ClientResponse, on_chunk=None,
                keep_partial: bool = False) -> web.StreamResponse:  # fmt: skip
    """Send `upstream`'s response to the client of `request`, chunk by chunk (`on_chunk()` before each). With
    `keep_partial`, an upstream lost mid-stream ends the client's response where it stopped; otherwise the client's
    connection fails too."""
    response = web.StreamResponse(status=upstream.status, headers=end_to_end(upstream.headers))
    await response.prepare(request)
    lost = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) if keep_partial else ()
    with contextlib.suppress(*lost):
        async for chunk in upstream.content.iter_any():
            if on_chunk is not None:
                on_chunk()
            await response.write(chunk)
    await response.write_eof()
    return response


class HoldingProxy:
    """A proxy whose requests wait in `waiting` until `ready` is set. `config` has `max_held`, `max_body_bytes` and
    `api_key` (and `host`, `port` for `run`). The subclass handles requests (`handle`) and names the tasks that run
    beside them (`background`): they start with the app, after its upstream session, and are cancelled when it
    stops."""

    def __init__(self, config, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = registry or CollectorRegistry()
        self.ready = asyncio.Event()
        self.waiting = WaitingRoom(self.ready, config.max_held)
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        # prometheus-client's own handler: the sidecar's works around `vllm:` names, of which these have none
        self.metrics = make_aiohttp_handler(self.registry)

    def background(self) -> list[Coroutine]:
        return []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def start(self, app: web.Application) -> None:
        # No connection limit (aiohttp's default is 100): every held request goes at once when an upstream is ready,
        # and a stream holds its connection to the end. --max-held and the pods' admission bound them.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        key = self.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None  # a relayed request's own header wins
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)
        self.tasks.extend(asyncio.create_task(work) for work in self.background())

    async def stop(self, app: web.Application) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()

    def routes(self) -> dict[str, object]:
        """GET path -> handler, served before every other request goes to `handle`."""
        return {"/metrics": self.metrics}

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._check_key])
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        for path, handler in self.routes().items():
            app.router.add_get(path, handler)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app[PROXY] = self
        return app

    @web.middleware
    async def _check_key(self, request: web.Request, handler):
        if needs_key(request.path, request.headers.get("Authorization", ""), self.config.api_key):
            return web.json_response(UNAUTHORIZED, status=401)
        return await handler(request)


PROXY = web.AppKey("proxy", HoldingProxy)


def check_key_and_urls(api_key: str | None, urls: list[str]) -> None:
    """A URL's own credentials (user:password@) and the key would be two Authorization headers: refused."""
    if api_key and any((parts := urlsplit(url)).username or parts.password is not None for url in urls):
        raise ConfigError("an upstream URL with credentials (user:password@) cannot be combined with --api-key-env")


def api_key_from_env(name: str | None) -> str | None:
    """The API key in environment variable `name` (--api-key-env); None without a name."""
    if name is None:
        return None
    key = os.environ.get(name, "").strip()
    if not key:
        raise ConfigError(f"the API key environment variable {name} is unset or empty")
    return key


def add_listen_flags(parser: argparse.ArgumentParser, defaults) -> None:
    """--host, --port, --max-held, --hold-timeout-s and --api-key-env, with `defaults`' values."""
    parser.add_argument("--host", default=defaults.host, help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="listen port (default %(default)d)")
    parser.add_argument("--max-held", type=int, default=defaults.max_held,
                        help="most requests held at once (default %(default)d)")  # fmt: skip
    parser.add_argument("--hold-timeout-s", type=float, default=defaults.hold_timeout_s,
                        help="longest wait for a ready upstream, then a 503 (default %(default)g)")  # fmt: skip
    parser.add_argument("--api-key-env", metavar="NAME",
                        help="an environment variable holding the pods' API key: required of clients on /v1/*, and "
                             "sent on this proxy's own requests to the pods (off by default)")  # fmt: skip


def run(proxy: HoldingProxy, log: logging.Logger, what: str) -> int:
    """Serve `proxy` on its config's host and port until SIGINT/SIGTERM."""
    log.info("%s on %s:%d, %s", log.name.rsplit(".", 1)[-1], proxy.config.host, proxy.config.port, what)
    web.run_app(proxy.build_app(), host=proxy.config.host, port=proxy.config.port, print=None,
                handle_signals=True)  # fmt: skip
    return 0
