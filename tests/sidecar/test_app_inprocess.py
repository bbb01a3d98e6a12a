"""The aiohttp app in-process (`init_app(config)` with a fresh registry per test), with no engine behind it:
readiness, OpenAI-shaped errors and metrics without any process."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Gauge

from overlap.sidecar.app import init_app
from overlap.sidecar.config import SidecarConfig
from overlap.sidecar.http import metrics_handler


async def make_client(tmp_path, **overrides) -> TestClient:
    config = SidecarConfig(engine_socket=str(tmp_path / "nobody.sock"), **overrides)
    client = TestClient(TestServer(init_app(config, CollectorRegistry())))
    await client.start_server()
    return client


async def test_without_an_engine_the_app_is_live_but_not_ready(tmp_path):
    client = await make_client(tmp_path)
    try:
        assert (await client.get("/healthz")).status == 200
        ready = await client.get("/readyz")
        assert ready.status == 503 and (await ready.json())["engine_connected"] is False
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status == 503 and response.headers["Retry-After"] == "1"
        assert (await response.json())["error"]["code"] == "engine_unavailable"
        metrics = await (await client.get("/metrics")).text()
        assert "overlap_engine_up 0.0" in metrics
        assert 'overlap_requests_rejected_total{reason="engine_unavailable"} 1.0' in metrics
        assert "vllm:num_requests_waiting" not in metrics  # no engine figures while the engine is away
        models = await client.get("/v1/models")  # no engine, no model: not an empty list with 200
        assert models.status == 503 and models.headers["Retry-After"] == "1"
        assert (await models.json())["error"]["code"] == "engine_unavailable"
    finally:
        await client.close()


async def test_api_key_is_checked_before_anything_else(tmp_path):
    client = await make_client(tmp_path, api_key="sk-abc12345")
    try:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status == 401 and (await response.json())["error"]["code"] == "invalid_api_key"
        assert (await client.get("/healthz")).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'overlap_requests_rejected_total{reason="unauthorized"} 1.0' in metrics
    finally:
        await client.close()


async def test_metrics_keep_colon_names_when_the_scraper_asks_for_openmetrics():
    """Prometheus sends an OpenMetrics Accept header; `vllm:` samples must keep their names (client_python#1177)."""
    from aiohttp import web

    registry = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(3)
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(registry))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        response = await client.get("/metrics", headers={"Accept": accept})
        assert response.headers["Content-Type"].startswith("text/plain;")
        assert "\nvllm:num_requests_waiting 3.0\n" in await response.text()
    finally:
        await client.close()
