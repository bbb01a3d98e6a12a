"""JSON in and out for every handler of the sidecar (public and admin ports), and its /metrics."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from overlap.sidecar.state import STATE, ApiError

_json = msgspec.json.Encoder()


def encode_json(data) -> bytes:
    return _json.encode(data)


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json", headers=headers)


async def read_body(request: web.Request, kind: type):
    """Decode and type-check a JSON body; every failure is a 400 naming what is wrong (408 for a body that does not
    arrive in time, 413 for one too big)."""
    timeout_s = request.app[STATE].config.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            body = await request.read()  # over client_max_size: 413 from aiohttp, rendered by the error middleware
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="body_timeout") from None
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        param = message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None
        raise ApiError(400, f"invalid request: {message}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "the request body is nested too deeply") from exc


def metrics_handler(registry: CollectorRegistry):
    """GET /metrics in the classic text format, whatever the scraper's Accept header offers.

    prometheus-client 0.26 writes the OpenMetrics format that Prometheus asks for by default with `vllm:` sample
    names turned into `vllm_` while their TYPE lines keep the colon (prometheus/client_python#1177), so Prometheus
    would store none of the `vllm:` series that routers and KEDA recipes query. The text format has no such step.
    """

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics
