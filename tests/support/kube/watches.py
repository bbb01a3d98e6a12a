"""Watches as a real API server serves them: resume from a resourceVersion (the server keeps a replayable event log,
and answers 410 Expired for one older than its compacted history), `sendInitialEvents` with its bookmark, label and
field selectors, `timeoutSeconds` ending the stream, and streams the server cuts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kmock._internal import rendering

from tests.support.kube.selectors import match_fields, match_labels

WATCH_END = (None, None)  # put on a watcher's queue: its stream ends (the server cut it)


async def watch_events(server, request: rendering.Request) -> AsyncIterator[Any]:
    """One watch stream on `server` (an ApiServer): the replayed backlog from `resourceVersion` (or the current
    objects, with the initial-events-end bookmark for a streaming list), then live events, until `timeoutSeconds`."""
    yield b""  # send the headers now, even if nothing happens for a while
    since = request.params.get("resourceVersion", "")
    timeout = float(request.params.get("timeoutSeconds") or 0) or None
    labels, fields = request.params.get("labelSelector", ""), request.params.get("fieldSelector", "")

    def wanted(res, event: dict) -> bool:
        obj = event["object"]
        meta = obj.get("metadata", {})
        if event["type"] == "BOOKMARK":
            return res == request.resource
        return (
            res == request.resource
            and (request.namespace is None or meta.get("namespace") == request.namespace)
            and (request.name is None or meta.get("name") == request.name)
            and match_labels(meta.get("labels") or {}, labels)
            and match_fields(obj, fields)
        )

    queue: asyncio.Queue = asyncio.Queue()
    async with server._lock:  # replay and subscribe atomically: no event falls in between
        initial = request.params.get("sendInitialEvents") == "true"
        if since and since != "0" and not initial and int(since) < server.compacted_rv:
            # what kube-apiserver's watch cache answers: an ERROR event with a 410 Status, then the stream ends
            message = f"too old resource version: {since} ({server.compacted_rv})"
            status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": "Expired", "code": 410}  # fmt: skip
            yield {"type": "ERROR", "object": status}
            return
        if since and since != "0" and not initial:
            backlog = [(res, ev) for rv, res, ev in server.events if rv > int(since)]
        else:
            backlog = [(request.resource, {"type": "ADDED", "object": obj}) for obj in server._visible(request)]
        if initial:  # a streaming list (kubectl's WatchList): the bookmark says the initial objects are all sent
            res = request.resource
            end = {
                "apiVersion": f"{res.group}/{res.version}".lstrip("/"),
                "kind": server.infos[res][0],
                "metadata": {
                    "resourceVersion": str(server.last_rv),
                    "annotations": {"k8s.io/initial-events-end": "true"},
                },
            }
            backlog.append((res, {"type": "BOOKMARK", "object": end}))
        server.watchers.add(queue)
    try:
        for res, event in backlog:
            if wanted(res, event):
                yield event
        async with asyncio.timeout(timeout):
            while True:
                res, event = await queue.get()
                if event is None:  # WATCH_END
                    return
                if wanted(res, event):
                    yield event
    except TimeoutError:
        return
    finally:
        server.watchers.discard(queue)
