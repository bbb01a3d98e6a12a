"""GET /v1/kv-events: what this replica's prefix cache added and evicted, and its load, for a prefix-aware router
(`overlap router`) that polls every replica.

`?since=N&epoch=E` asks for the changes after event N of engine E (the `next_seq` and `epoch` of the previous
answer); the first poll, an engine restart or a reader too far behind gets a snapshot (`reset: true`). Block
hashes follow `overlap.engine.prefix_hash` (`hash_scheme`), over blocks of `block_size` tokens: the
router takes both from here, never from its own settings.
"""

from __future__ import annotations

from aiohttp import web

from overlap.engine.serving.client import EngineUnavailable
from overlap.sidecar.http import json_response
from overlap.sidecar.state import STATE, ApiError, engine_unavailable


async def kv_events(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        raise ApiError(400, "since must be an integer (the next_seq of the previous answer)", param="since") from None
    if not 0 <= since < 2**63:
        raise ApiError(400, "since must be in 0..2**63-1", param="since")
    try:
        reply = await state.client.kv_events(since, request.query.get("epoch", ""))
    except EngineUnavailable as exc:
        raise engine_unavailable(str(exc)) from None
    admission = state.admission
    load = {**reply.load, "queued": admission.num_queued, "inflight": admission.num_inflight}
    return json_response({
        "epoch": reply.epoch, "block_size": reply.block_size, "hash_scheme": reply.hash_scheme,
        "next_seq": reply.next_seq, "reset": reply.reset, "events": reply.events,
        "load": load, "ready": state.ready, "draining": state.draining,
    })  # fmt: skip
