"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters added to and removed from the running
engine, refused unless the sidecar runs with --allow-runtime-lora-updating true (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). The admin port has the same two behind its bearer token
(`/admin/lora/load`, `/admin/lora/unload`: what the operator calls), whatever that switch says.

The engine reads and checks an adapter before it is listed; an unloaded adapter's running and queued requests finish
with it, new ones naming it get 404. `load_inplace` moves a loaded name to a new folder once that folder reads
(requests accepted before finish with the old one); if it does not, the old one keeps serving. Both answer with
vLLM's plain-text line on success.
"""

from __future__ import annotations

from aiohttp import web

from overlap.engine.serving.client import EngineUnavailable
from overlap.openai import schemas
from overlap.sidecar.http import read_body
from overlap.sidecar.state import STATE, ApiError, engine_unavailable


async def load_lora_adapter(request: web.Request) -> web.Response:
    _check_allowed(request)
    return await load(request)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    _check_allowed(request)
    return await unload(request)


def _check_allowed(request: web.Request) -> None:
    if not request.app[STATE].config.allow_runtime_lora_updating:
        raise ApiError(403, "runtime LoRA updating is off: start the sidecar with --allow-runtime-lora-updating true "
                       "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", code="lora_updating_disabled")  # fmt: skip


async def load(request: web.Request) -> web.Response:
    """A load, on whichever port allowed it."""
    body = await read_body(request, schemas.LoadLoraAdapterRequest)
    await _update(request, body.lora_name, body.lora_path, body.load_inplace)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload(request: web.Request) -> web.Response:
    """An unload, on whichever port allowed it."""
    body = await read_body(request, schemas.UnloadLoraAdapterRequest)
    await _update(request, body.lora_name, None)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _update(request: web.Request, name: str, path: str | None, replace: bool = False) -> None:
    state = request.app[STATE]
    if not name:
        raise ApiError(400, "lora_name must not be empty", param="lora_name")
    if name == state.model_name:
        raise ApiError(400, f"{name!r} is the base model's name", param="lora_name")
    try:
        reply = await state.client.update_lora(name, path, replace)
    except EngineUnavailable as exc:
        raise engine_unavailable(str(exc)) from exc
    state.lora_adapters = dict(reply.adapters)
    if reply.error is not None:
        raise ApiError(404 if reply.not_found else 400, reply.error, param="lora_name" if reply.not_found else None)
