"""Probes and the version: liveness, readiness, and the health checks load generators and clients send."""

from __future__ import annotations

from aiohttp import web

from overlap.sidecar.http import json_response
from overlap.sidecar.state import STATE


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the sidecar process answers (the engine being away is a readiness matter)."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness (also /health, which load generators probe, and /ping, which vLLM's and SageMaker's clients do):
    200 when requests can be served."""
    state = request.app[STATE]
    body = {
        "ready": state.ready,
        "engine_connected": state.client.connected,
        "tokenizer_loaded": state.text is not None,
        "draining": state.draining,
    }
    return json_response(body, status=200 if state.ready else 503)


async def version(request: web.Request) -> web.Response:
    from importlib.metadata import version as dist_version

    return json_response({"version": dist_version("overlap-sidecar")})
