"""The sidecar's side of the engine socket: submit requests, stream their outputs, abort, ask for stats and
reconfigure. One reader task dispatches frames; a supervisor task reconnects whenever the engine goes away, and
fails every in-flight request at once when it does."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

from overlap.engine.config import LiveKnobs
from overlap.engine.errors import ConfigError
from overlap.engine.serving import protocol as p
from overlap.engine.types import RequestSpec

log = logging.getLogger(__name__)


class EngineUnavailable(Exception):
    """The engine is not connected (not started yet, restarting, or gone)."""


class EngineRejected(Exception):
    """The engine refused a request at add time (kind: invalid_request | unknown_adapter | shutting_down |
    internal)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RequestStream:
    """Outputs of one request, in order; the last one has `finished` set. Errors arrive as exceptions."""

    __slots__ = ("queue", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[p.WireOutput | Exception] = asyncio.Queue()

    async def next(self) -> p.WireOutput:
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item


class EngineClient:
    def __init__(self, socket_path: str, on_hello: Callable[[p.Hello], object] | None = None) -> None:
        self.socket_path = socket_path
        self.hello: p.Hello | None = None  # set while connected
        self.latest_stats: dict | None = None  # refreshed by the stats poller
        self._on_hello = on_hello
        self._writer: asyncio.StreamWriter | None = None
        self._streams: dict[str, RequestStream] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._seq = itertools.count(1)
        self._connected = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self._writer is not None and self.hello is not None

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    async def wait_connected(self, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):  # never asyncio.wait_for: see _ask
            await self._connected.wait()

    # ---- connection lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve the connection until it drops, reconnect; forever (until cancelled)."""
        delay = 0.05
        logged_waiting = False
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as exc:
                if not logged_waiting:
                    log.info("waiting for the engine at %s (%s)", self.socket_path, exc.strerror or exc)
                    logged_waiting = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            logged_waiting = False
            delay = 0.05
            try:
                await self._serve_connection(reader, writer)
            except (OSError, p.ProtocolError) as exc:
                log.warning("engine connection failed: %s", exc)
            finally:
                stopping = asyncio.current_task().cancelling() > 0
                self._lost("the sidecar is stopping" if stopping else "the engine connection was lost", quiet=stopping)
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await p.read_message_async(reader)
        if not isinstance(hello, p.Hello):
            raise p.ProtocolError(f"expected Hello first, got {type(hello).__name__}")
        if hello.protocol_version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(f"engine speaks protocol {hello.protocol_version}, expected {p.PROTOCOL_VERSION}")
        if self._on_hello is not None:
            result = self._on_hello(hello)
            if asyncio.iscoroutine(result):
                await result  # e.g. load the tokenizer before declaring the connection usable
        self.hello, self._writer = hello, writer
        self._connected.set()
        log.info("engine connected: model %s (pid %d)", hello.model_name, hello.engine_pid)
        while True:
            message = await p.read_message_async(reader)
            if message is None:
                return
            self._dispatch(message)

    def _dispatch(self, message: p.Message) -> None:
        if isinstance(message, p.Outputs):
            for out in message.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted here already
                if out.finished:
                    del self._streams[out.request_id]
                stream.queue.put_nowait(out)
        elif isinstance(message, p.RequestError):
            stream = self._streams.pop(message.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(EngineRejected(message.kind, message.message))
        elif isinstance(message, (p.StatsReply, p.ReconfigureReply, p.KvEventsReply, p.LoraUpdateReply)):
            future = self._replies.pop(message.seq, None)
            if future is not None and not future.done():
                future.set_result(message)
        else:
            log.warning("unexpected %s from the engine; ignored", type(message).__name__)

    def _lost(self, reason: str, quiet: bool = False) -> None:
        was_connected = self.hello is not None
        self.hello, self._writer, self.latest_stats = None, None, None
        self._connected.clear()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(EngineUnavailable(reason))
        replies, self._replies = self._replies, {}
        for future in replies.values():
            if not future.done():
                future.set_exception(EngineUnavailable(reason))
        if was_connected and not quiet:
            log.warning("%s; failed %d in-flight requests", reason, len(streams))

    def _send(self, message: p.Message) -> None:
        if self._writer is None or self.hello is None:
            raise EngineUnavailable("the engine is not connected")
        self._writer.write(p.encode(message))

    # ---- requests -------------------------------------------------------------------------------------------

    def submit(self, spec: RequestSpec) -> RequestStream:
        stream = RequestStream(spec.request_id)
        self._send(p.AddRequest.from_record(spec))
        self._streams[spec.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; nothing more arrives on its stream. Harmless when it already finished."""
        if self._streams.pop(request_id, None) is None:
            return
        with contextlib.suppress(EngineUnavailable):
            self._send(p.Abort([request_id]))

    async def _ask(self, make, timeout: float):
        seq = next(self._seq)
        future = asyncio.get_running_loop().create_future()
        self._replies[seq] = future
        try:
            self._send(make(seq))
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the reply instead of raising when the
            # task is cancelled as the reply arrives (CPython gh-86296), and a poller that lost its cancel kept the
            # sidecar from ever finishing its shutdown.
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError as exc:
            raise EngineUnavailable(f"the engine did not answer within {timeout:g} s") from exc
        finally:
            self._replies.pop(seq, None)

    async def stats(self, timeout: float = 5.0) -> dict:
        reply = await self._ask(lambda seq: p.StatsRequest(seq), timeout)
        self.latest_stats = reply.stats
        return reply.stats

    async def kv_events(self, since: int, epoch: str, timeout: float = 5.0) -> p.KvEventsReply:
        """The prefix cache's changes after event `since` of engine `epoch` (a snapshot when that is stale)."""
        return await self._ask(lambda seq: p.KvEventsRequest(seq, since, epoch), timeout)

    async def reconfigure(self, knobs: LiveKnobs, timeout: float = 10.0) -> LiveKnobs:
        """Run `knobs` from the engine's next step on; returns what it runs. ConfigError when the engine refuses."""
        reply = await self._ask(lambda seq: p.Reconfigure(seq, knobs), timeout)
        if reply.error is not None:
            raise ConfigError(reply.error)
        return reply.applied

    async def update_lora(self, name: str, path: str | None, replace: bool = False,
                          timeout: float = 60.0) -> p.LoraUpdateReply:  # fmt: skip
        """Load LoRA adapter `name` from `path` (None: unload it; `replace`: a loaded name moves to `path`); the
        reply has the adapters after it, or the error that left them as they were."""
        return await self._ask(lambda seq: p.LoraUpdate(seq, name, path, replace), timeout)
