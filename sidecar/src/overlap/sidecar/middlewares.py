"""The middlewares the public and the admin apps share: every error as OpenAI's error object, and the API key."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from overlap.openai.auth import UNAUTHORIZED, needs_key
from overlap.sidecar.http import json_response
from overlap.sidecar.state import STATE, ApiError

log = logging.getLogger(__name__)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error leaves as OpenAI's error object: ours (ApiError), aiohttp's (404, 405, 413), and bugs (500)."""
    try:
        return await handler(request)
    except ApiError as exc:
        _count_client_error(request, exc.status)
        return json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        _count_client_error(request, exc.status)
        message = exc.text or exc.reason  # for 413, aiohttp names the limit and the body size
        error = ApiError(exc.status, message, "not_found_error" if exc.status == 404 else "invalid_request_error")
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None  # a 405 names the methods
        return json_response(error.body(), status=exc.status, headers=allow)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        error = ApiError(500, "internal server error", "internal_error")
        return json_response(error.body(), status=500)


def _count_client_error(request: web.Request, status: int) -> None:
    """Bad API requests count as rejections too (429 and 503 are counted where they are decided)."""
    if 400 <= status < 500 and status != 429 and request.path.startswith("/v1/"):
        reason = "unauthorized" if status == 401 else "invalid"
        request.app[STATE].metrics.rejected_by[reason].inc()


@web.middleware
async def api_key_auth(request: web.Request, handler):
    if needs_key(request.path, request.headers.get("Authorization", ""), request.app[STATE].config.api_key):
        error = UNAUTHORIZED["error"]
        raise ApiError(401, error["message"], error["type"], code=error["code"])
    return await handler(request)
