"""The router's and the activator's shared base, in process: the waiting room, and a `HoldingProxy` (the activator)
that holds a request until its upstream is ready, then relays the answer as it came, chunk by chunk, with only the
end-to-end headers."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from overlap.engine.errors import ConfigError
from overlap.gateway.activator import Activator, ActivatorConfig
from overlap.gateway.proxy import PROXY
from overlap.gateway.waiting import WaitingRoom


async def test_the_waiting_room_counts_its_requests_until_ready_or_their_deadline():
    ready = asyncio.Event()
    room = WaitingRoom(ready, limit=2)
    soon = time.monotonic() + 0.05
    late = asyncio.create_task(room.wait(soon))
    waiter = asyncio.create_task(room.wait(time.monotonic() + 5))
    await asyncio.sleep(0.01)
    assert room.count == 2 and room.full()
    assert await late is False  # its deadline came first
    assert room.count == 1 and not room.full()
    ready.set()
    assert await waiter is True and room.count == 0
    assert await room.wait(time.monotonic() - 1) is True  # ready: at once, whatever the deadline
    pause = asyncio.create_task(room.pause(0.02))
    await asyncio.sleep(0.005)
    assert room.count == 1
    await pause
    assert room.count == 0


async def test_a_held_request_is_relayed_chunk_by_chunk_once_the_upstream_is_ready():
    upstream_ready = False
    seen: dict = {}

    async def readyz(request: web.Request) -> web.Response:
        return web.Response(status=200 if upstream_ready else 503)

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.update(headers=dict(request.headers), body=await request.read())
        response = web.StreamResponse(headers={"X-Upstream": "yes", "Keep-Alive": "timeout=5"})
        await response.prepare(request)
        for part in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await response.write(part)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    upstream_app = web.Application()
    upstream_app.router.add_get("/readyz", readyz)
    upstream_app.router.add_post("/v1/completions", stream)
    async with TestServer(upstream_app) as upstream:
        config = ActivatorConfig(upstream=str(upstream.make_url("")), probe_interval_s=0.02, hold_timeout_s=10)
        async with TestServer(Activator(config).build_app()) as proxy, aiohttp.ClientSession() as client:
            activator = proxy.app[PROXY]
            sent = asyncio.create_task(client.post(proxy.make_url("/v1/completions"), data=b'{"prompt": "hi"}',
                                                   headers={"X-Client": "1", "Connection": "keep-alive"}))  # fmt: skip
            await asyncio.sleep(0.2)
            assert not sent.done() and activator.waiting.count == 1  # held: the upstream is not ready
            upstream_ready = True
            async with await sent as response:
                chunks = [chunk async for chunk in response.content.iter_any()]
                assert response.status == 200 and response.headers["X-Upstream"] == "yes"
                assert "Keep-Alive" not in response.headers  # hop-by-hop: not passed on
            assert b"".join(chunks) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            assert seen["body"] == b'{"prompt": "hi"}' and seen["headers"]["X-Client"] == "1"
            assert activator.waiting.count == 0
            metrics = await (await client.get(proxy.make_url("/metrics"))).text()
            assert 'overlap_activator_requests_total{outcome="forwarded"} 1.0' in metrics


async def test_a_keyed_activator_refuses_a_client_without_the_key_before_holding_it():
    """--api-key-env (the pods' key): a request to /v1/ without it gets the sidecar's 401 at once, not a place in the
    waiting room a stranger could fill; one with it is held and relayed with its own header; /metrics stays open."""
    seen: list[str | None] = []
    upstream_ready = False

    async def readyz(request: web.Request) -> web.Response:
        return web.Response(status=200 if upstream_ready else 503)

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"ok": True})

    upstream_app = web.Application()
    upstream_app.router.add_get("/readyz", readyz)
    upstream_app.router.add_post("/v1/completions", completions)
    async with TestServer(upstream_app) as upstream:
        config = ActivatorConfig(upstream=str(upstream.make_url("")), probe_interval_s=0.02, hold_timeout_s=10,
                                 api_key="s3cret")  # fmt: skip
        async with TestServer(Activator(config).build_app()) as proxy, aiohttp.ClientSession() as client:
            activator = proxy.app[PROXY]
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with client.post(proxy.make_url("/v1/completions"), json={}, headers=headers) as response:
                    assert response.status == 401
                    assert (await response.json())["error"]["code"] == "invalid_api_key"
            assert activator.waiting.count == 0
            assert (await client.get(proxy.make_url("/metrics"))).status == 200
            sent = asyncio.create_task(client.post(proxy.make_url("/v1/completions"), json={},
                                                   headers={"Authorization": "Bearer s3cret"}))  # fmt: skip
            await asyncio.sleep(0.2)
            assert not sent.done() and activator.waiting.count == 1
            upstream_ready = True
            async with await sent as response:
                assert response.status == 200
            assert seen == ["Bearer s3cret"]
    with pytest.raises(ConfigError, match="credentials"):  # two Authorization headers: refused at start
        ActivatorConfig(upstream="http://user:pass@pods:8000", api_key="s3cret")
