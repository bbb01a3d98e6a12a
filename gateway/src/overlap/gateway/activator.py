"""`overlap activator`: the proxy a service's clients reach while it has no ready replica.

A service scaled to zero must not answer 404 or refuse the connection: its first request is what should wake it.
The activator accepts every request, holds it (up to `--max-held` requests, each at most `--hold-timeout-s`) while
the upstream (the service's pods) is not ready, and reports how many it holds at `/metrics`
(`overlap_activator_queued_requests`), which the operator's control loop reads to scale 0 -> 1 at once. It probes
the upstream's `/readyz`; once that answers 200 it forwards what it holds, streams included, and everything after.
A request it cannot hold gets a 503 with `Retry-After`: the hold limit is reached, or its hold timed out. A pod
that has just woken may refuse part of the burst at admission (429, before any work is done): the activator keeps
such a request and sends it again after the pod's `Retry-After`, while its hold deadline allows. It relays as
every `proxy.HoldingProxy` does: plain HTTP, streams chunk by chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from overlap.engine.errors import ConfigError
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

log = logging.getLogger("overlap.activator")


@dataclass(slots=True)
class ActivatorConfig:
    upstream: str  # base URL of the service's pods, e.g. http://llm-pods.default.svc:8000
    host: str = "0.0.0.0"
    port: int = 8080
    max_held: int = 1000
    hold_timeout_s: float = 300.0
    probe_interval_s: float = 0.1  # part of the first token's delay after a pod becomes ready
    retry_after_s: int = 10
    max_body_bytes: int = 1024 * 1024
    api_key: str | None = None  # required of clients on /v1/*, sent to the pods (`proxy.HoldingProxy`)

    def __post_init__(self) -> None:
        if not self.upstream.startswith(("http://", "https://")):
            raise ConfigError(f"--upstream must be an http(s) URL, got {self.upstream!r}")
        if self.max_held < 1 or self.hold_timeout_s <= 0 or self.probe_interval_s <= 0 or self.retry_after_s < 1:
            raise ConfigError("--max-held, --hold-timeout-s, --probe-interval-s and --retry-after-s must be positive")
        self.upstream = self.upstream.rstrip("/")
        check_key_and_urls(self.api_key, [self.upstream])


class Activator(HoldingProxy):
    """`ready` is set while the upstream's /readyz answers 200."""

    def __init__(self, config: ActivatorConfig, registry: CollectorRegistry | None = None) -> None:
        super().__init__(config, registry)
        self.retried = 0  # requests a woken pod refused at admission and the activator sent again
        Gauge(
            "overlap_activator_queued_requests", "Requests held while the service has no ready replica",
            registry=self.registry,
        ).set_function(lambda: self.waiting.count)  # fmt: skip
        Gauge(
            "overlap_activator_upstream_ready",
            "1 when the upstream answers its readiness probe",
            registry=self.registry,
        ).set_function(lambda: 1 if self.ready.is_set() else 0)
        self.outcomes = Counter(
            "overlap_activator_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        for outcome in ("forwarded", "held_too_long", "hold_full", "upstream_error"):
            self.outcomes.labels(outcome)
        self.hold_time = Histogram(
            "overlap_activator_hold_seconds", "How long a forwarded request was held", registry=self.registry,
            buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )  # fmt: skip

    def routes(self) -> dict[str, object]:
        # At zero replicas the service's Service routes to the activator, so its ServiceMonitor scrapes it at /metrics.
        return {"/activator/healthz": self.healthz, "/activator/metrics": self.metrics, "/metrics": self.metrics}

    def background(self) -> list:
        return [self._probe()]

    async def _probe(self) -> None:
        url = f"{self.config.upstream}/readyz"
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.config.probe_interval_s * 4))
        while True:
            try:
                async with self.session.get(url, timeout=timeout) as response:
                    ok = response.status == 200
            except UPSTREAM_ERRORS:
                ok = False
            if ok and not self.ready.is_set():
                log.info(f"upstream {self.config.upstream} is ready; forwarding {self.waiting.count} held requests")
                self.ready.set()
            elif not ok and self.ready.is_set():
                log.info(f"upstream {self.config.upstream} is not ready; holding requests")
                self.ready.clear()
            await asyncio.sleep(self.config.probe_interval_s)

    # ------------------------------------------------------------------------------------------------ requests

    def _refuse(self, outcome: str, message: str) -> web.Response:
        self.outcomes.labels(outcome).inc()
        body = {"error": {"message": message, "type": "service_unavailable", "code": outcome}}
        return web.json_response(body, status=503, headers={"Retry-After": str(self.config.retry_after_s)})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        deadline = arrived + self.config.hold_timeout_s
        if not self.ready.is_set() and self.waiting.full():
            return self._refuse("hold_full", f"the service is starting and {self.waiting.count} requests already wait")
        body = await request.read()
        attempt = 0
        while True:
            if not await self.waiting.wait(deadline):
                return self._refuse(
                    "held_too_long", f"the service did not become ready within {self.config.hold_timeout_s:g} s"
                )
            response = await self._forward(request, body, arrived, deadline, attempt)
            attempt += 1
            if isinstance(response, web.StreamResponse):
                return response
            if response is None:
                # Not connected (the pod went away between probes): the request was not sent; hold it again.
                self.ready.clear()
                continue
            # A pod that just woke refused it at admission (429/503, before any work): hold it a little longer.
            self.retried += 1
            await self.waiting.pause(response)

    async def _forward(
        self, request: web.Request, body: bytes, arrived: float, deadline: float, attempt: int
    ) -> web.StreamResponse | float | None:
        """Relay the request and its response. None when the upstream refused the connection (nothing sent); the
        seconds to wait when it refused the request at admission (429, or 503 while not ready) and the deadline
        leaves time to try again (its answer is relayed otherwise)."""
        url = f"{self.config.upstream}{request.rel_url}"
        try:
            upstream = await self.session.request(request.method, url, headers=end_to_end(request.headers),
                                                  data=body or None)  # fmt: skip
        except aiohttp.ClientConnectorError:
            return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            return self._refuse("upstream_error", f"the service failed the request: {exc}")
        try:
            if upstream.status in (429, 503):
                # sooner than the pod's Retry-After at first: its queue drains fast once it serves
                wait = min(_retry_after(upstream.headers.get("Retry-After")), 0.1 * 2**attempt)
                if time.monotonic() + wait < deadline:
                    return wait
            self.hold_time.observe(time.monotonic() - arrived)
            self.outcomes.labels("forwarded").inc()
            return await relay(request, upstream)
        finally:
            upstream.release()

    async def healthz(self, request: web.Request) -> web.Response:
        status = {"held": self.waiting.count, "upstream_ready": self.ready.is_set(), "retried": self.retried}
        return web.json_response(status)


def _retry_after(value: str | None) -> float:
    """A Retry-After in seconds (the sidecar sends whole seconds), between 0.1 and 5 s; 0.5 s when absent."""
    try:
        return min(max(float(value), 0.1), 5.0) if value is not None else 0.5
    except ValueError:
        return 0.5


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "activator",
        help="hold requests while a service has no ready replica (scale from zero), then forward them",
        description=__doc__.splitlines()[0],
    )
    defaults = ActivatorConfig(upstream="http://placeholder")
    parser.add_argument("--upstream", required=True, help="base URL of the service's pods (http://HOST:PORT)")
    add_listen_flags(parser, defaults)
    parser.add_argument("--probe-interval-s", type=float, default=defaults.probe_interval_s,
                        help="how often the upstream's /readyz is asked (default %(default)g)")  # fmt: skip
    parser.add_argument("--retry-after-s", type=int, default=defaults.retry_after_s,
                        help="Retry-After of a 503 (default %(default)d)")  # fmt: skip
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    config = ActivatorConfig(
        upstream=args.upstream,
        host=args.host,
        port=args.port,
        max_held=args.max_held,
        hold_timeout_s=args.hold_timeout_s,
        probe_interval_s=args.probe_interval_s,
        retry_after_s=args.retry_after_s,
        api_key=api_key_from_env(args.api_key_env),
    )
    return run(Activator(config), log, f"for {config.upstream}")
