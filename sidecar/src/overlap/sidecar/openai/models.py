"""GET /v1/models: the served model, and each LoRA adapter with the base as its `parent` (vLLM's shape)."""

from __future__ import annotations

from aiohttp import web

from overlap.sidecar.http import json_response
from overlap.sidecar.state import STATE, engine_unavailable


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.client.connected or not state.model_name:
        # An empty list with 200 would tell a client's start-up probe that this server serves nothing.
        raise engine_unavailable("the engine is not connected yet, so no model is served; retry shortly")
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "overlap",
             "max_model_len": state.max_model_len}  # fmt: skip
    if state.quantization:  # the format the weights are stored and computed in
        model["quantization"] = state.quantization
    adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "overlap", "root": path,
                 "parent": state.model_name, "max_model_len": state.max_model_len}
                for name, path in sorted(state.lora_adapters.items())]  # fmt: skip
    return json_response({"object": "list", "data": [model, *adapters]})
