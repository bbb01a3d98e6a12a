"""`overlap engine --socket PATH`: the engine process of a pod, serving token ids on a Unix domain socket.

Threads: an accept thread, one reader thread per connection (frames -> the inbox queue), a thread for LoRA adapter
loads and unloads (a load reads the folder, which can take a while: the steps go on meanwhile; updates run in the
order they came, and the reply goes back through the inbox), and the loop thread (the main thread) that alone steps
the Engine: "process input, do one step" inside a shutdown check. When the engine has nothing to do, or its requests
only wait, the loop sleeps on the inbox instead of spinning. Outputs are sent from the loop thread, all of one step's
outputs for a connection in one frame.

SIGTERM: new requests are refused, in-flight ones run to completion, and the process exits once the sidecars
have hung up (they drain first) or the grace period (`OVERLAP_GRACE_PERIOD_S`, default 30 s) is over. A second
SIGTERM (or SIGINT) stops at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError, InvalidRequestError, OverlapError, UnknownAdapterError
from overlap.engine.prefix_hash import HASH_SCHEME, snapshot_events
from overlap.engine.serving import protocol as p

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop sleeps on the inbox before re-checking for shutdown


def load_engine_config(
    config_path: str | os.PathLike | None, model: str | None = None, overrides: dict[str, Any] | None = None
) -> EngineConfig:
    """EngineConfig from a JSON or YAML file of its field names (YAML is a superset of JSON); `model` and the
    command line's `overrides` win over the file."""
    fields: dict[str, Any] = {}
    if config_path:
        fields = read_config_file(config_path)
    if model:
        fields["model"] = model
    fields.update(overrides or {})
    return EngineConfig().replace(**fields)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read engine config {path}: {exc}") from exc
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"engine config {path} is not valid JSON or YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"engine config {path} must be a mapping of EngineConfig fields, got {type(data).__name__}")
    return data


@dataclass(eq=False)
class _Connection:
    id: int
    sock: socket.socket
    alive: bool = True
    request_ids: set[str] = field(default_factory=set)  # engine-side ids of its unfinished requests

    def send(self, message: p.Message) -> None:
        if not self.alive:
            return
        try:
            self.sock.sendall(p.encode(message))
        except OSError as exc:  # the reader thread sees the same and reports the disconnect
            log.info("connection %d: send failed (%s)", self.id, exc)
            self.alive = False


_CONNECTED = object()  # inbox marker: (conn, _CONNECTED); (conn, None) means it went away


@dataclass(frozen=True)
class _LoraDone:
    """Inbox item: a LoRA update the adapter thread finished, for the loop to reply to."""

    reply: p.LoraUpdateReply


class EngineServer:
    """Serves one Engine to any number of sidecar connections; request ids are namespaced per connection."""

    def __init__(
        self,
        engine,
        socket_path: str | os.PathLike,
        grace_period_s: float = 30.0,
        served_model_name: str | None = None,
    ) -> None:
        self.served_model_name = served_model_name
        self.engine = engine
        self.socket_path = str(socket_path)
        self.grace_period_s = grace_period_s
        self._inbox: queue.Queue = queue.Queue()
        self._owners: dict[str, tuple[_Connection, str]] = {}  # engine request id -> (connection, its id)
        self._connections: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._drain_deadline: float | None = None  # set by the first stop request
        self._hard_stop = threading.Event()
        self._listener: socket.socket | None = None
        self._hello_frame: p.Hello | None = None  # built by the loop thread (the engine is not thread-safe)
        self._tokenizer_files = read_tokenizer_files(Path(engine.model_dir))
        self._lora_updates = ThreadPoolExecutor(1, thread_name_prefix="engine-lora")

    # ---- control (safe from signal handlers and other threads: they only set flags) -------------------------

    def request_stop(self) -> None:
        """First call: drain (refuse new requests, finish in-flight ones within the grace period). Second: stop."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.grace_period_s
        else:
            self._hard_stop.set()
        self._inbox.put((None, None))  # wake an idle loop

    def _should_stop(self) -> bool:
        if self._hard_stop.is_set():
            return True
        if self._drain_deadline is None:
            return False
        # In a pod both containers get SIGTERM at once: stay until the sidecar has drained and hung up.
        idle = not self.engine.has_unfinished() and not self._connections
        return idle or time.monotonic() >= self._drain_deadline

    # ---- the loop ----------------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        self._hello_frame = self._hello()
        self._listen()
        threading.Thread(target=self._accept_loop, name="engine-accept", daemon=True).start()
        log.info("engine listening on %s (%s)", self.socket_path, self.engine.runner.kernels)
        split = getattr(self.engine.runner, "kv_split", None)
        if split is not None:
            log.info("%s", split.describe(self.engine.runner.block_size))
        try:
            waiting_only = False  # the last step ran nothing: requests wait (a batching policy, an adapter's read)
            while not self._should_stop():
                busy = self.engine.has_unfinished()
                self._process_input(block=not busy or waiting_only, timeout_s=_IDLE_WAIT_S if not busy else 0.001)
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._send_outputs(outputs)
                    waiting_only = not outputs and not self.engine.scheduler.running
                if self.engine.fatal is not None:  # its requests have their error; the sidecar answers the rest
                    log.error("the engine cannot go on: %s; exiting", self.engine.fatal)
                    break
        finally:
            self._close()

    def _process_input(self, block: bool, timeout_s: float = _IDLE_WAIT_S) -> None:
        try:
            item = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, conn: _Connection | None, message) -> None:
        if conn is None:
            return  # a wake-up
        if message is _CONNECTED:
            self._connections[conn.id] = conn
        elif message is None:
            self._disconnect(conn)
        elif isinstance(message, p.AddRequest):
            self._add(conn, message)
        elif isinstance(message, p.Abort):
            for request_id in message.request_ids:
                self.engine.abort(f"{conn.id}:{request_id}")
        elif isinstance(message, p.Reconfigure):
            try:
                applied = self.engine.reconfigure(message.knobs)
                self._hello_frame = self._hello()  # later connections see the new config
                conn.send(p.ReconfigureReply(seq=message.seq, applied=applied))
            except ConfigError as exc:
                conn.send(p.ReconfigureReply(seq=message.seq, error=str(exc)))
        elif isinstance(message, p.LoraUpdate):
            self._lora_updates.submit(lambda: self._inbox.put((conn, _LoraDone(self._update_lora(message)))))
        elif isinstance(message, _LoraDone):
            if not message.reply.error:
                self._hello_frame = self._hello()  # later connections see the adapters
            conn.send(message.reply)
        elif isinstance(message, p.StatsRequest):
            stats = dict(self.engine.stats())
            stats["num_connections"] = len(self._connections)
            stats["draining"] = self._drain_deadline is not None
            conn.send(p.StatsReply(seq=message.seq, stats=_plain(stats)))
        elif isinstance(message, p.KvEventsRequest):
            conn.send(self._kv_events(message))
        else:
            log.warning("connection %d sent an unexpected %s; ignored", conn.id, type(message).__name__)

    def _update_lora(self, message: p.LoraUpdate) -> p.LoraUpdateReply:
        loras = self.engine.loras
        try:
            if message.path is not None:
                loras.add(message.name, message.path, replace=message.replace)  # read and checked here
            elif not loras.remove(message.name):
                return p.LoraUpdateReply(message.seq, loras.snapshot(), f"no LoRA adapter {message.name!r} is loaded",
                                         not_found=True)  # fmt: skip
        except OverlapError as exc:  # ConfigError, LoraError: the reason, nothing changed
            return p.LoraUpdateReply(message.seq, loras.snapshot(), str(exc))
        except Exception as exc:  # a folder no check foresaw: refused, and the engine keeps serving
            log.exception("loading LoRA adapter %r failed", message.name)
            return p.LoraUpdateReply(message.seq, loras.snapshot(), f"adapter {message.name!r}: {exc!r}")
        return p.LoraUpdateReply(message.seq, loras.snapshot())

    def _kv_events(self, message: p.KvEventsRequest) -> p.KvEventsReply:
        bm = self.engine.block_manager
        events = bm.kv_events.since(message.since) if message.epoch == bm.kv_events.epoch else None
        reset = events is None
        if reset:
            events = snapshot_events(bm.cached_hashes())
        scheduler = self.engine.scheduler
        load = {"num_waiting": len(scheduler.waiting), "num_running": len(scheduler.running), "kv_usage": bm.usage}
        return p.KvEventsReply(seq=message.seq, epoch=bm.kv_events.epoch, block_size=bm.block_size,
                               hash_scheme=HASH_SCHEME, next_seq=bm.kv_events.next_seq, reset=reset, events=events,
                               load=load)  # fmt: skip

    def _add(self, conn: _Connection, message: p.AddRequest) -> None:
        if self._drain_deadline is not None:
            conn.send(p.RequestError(message.request_id, "the engine is shutting down", kind="shutting_down"))
            return
        engine_id = f"{conn.id}:{message.request_id}"  # ids are the sidecar's: unique per connection only
        sibling = message.share_prompt_with
        try:
            spec = message.to_record()
            spec.request_id = engine_id
            spec.share_prompt_with = None if sibling is None else f"{conn.id}:{sibling}"
            self.engine.add_request(spec)
        except InvalidRequestError as exc:
            kind = "unknown_adapter" if isinstance(exc, UnknownAdapterError) else "invalid_request"
            conn.send(p.RequestError(message.request_id, str(exc), kind=kind))
            return
        except Exception as exc:  # a bug in the engine must not take the connection down; say what happened
            log.exception("add_request failed for %s", engine_id)
            conn.send(p.RequestError(message.request_id, f"engine error: {exc}", kind="internal"))
            return
        self._owners[engine_id] = (conn, message.request_id)
        conn.request_ids.add(engine_id)

    def _send_outputs(self, outputs) -> None:
        batches: dict[_Connection, list[p.WireOutput]] = {}
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:
                continue
            conn, request_id = owner
            if out.finished:
                del self._owners[out.request_id]
                conn.request_ids.discard(out.request_id)
            if not conn.alive:
                continue
            wire = p.WireOutput.from_output(out, request_id)
            if wire.prompt_logprobs:  # up to ~16 MB (the sidecar's MAX_PROMPT_LOGPROBS): a frame of its own
                conn.send(p.Outputs([wire]))
            else:
                batches.setdefault(conn, []).append(wire)
        for conn, batch in batches.items():
            conn.send(p.Outputs(batch))

    def _disconnect(self, conn: _Connection) -> None:
        conn.alive = False
        self._connections.pop(conn.id, None)
        for engine_id in list(conn.request_ids):
            self.engine.abort(engine_id)  # their ABORT outputs are dropped in _send_outputs
        if conn.request_ids:
            log.info("connection %d went away; aborted its %d requests", conn.id, len(conn.request_ids))
        with contextlib.suppress(OSError):
            conn.sock.close()

    # ---- sockets -----------------------------------------------------------------------------------------------

    def _listen(self) -> None:
        path = Path(self.socket_path)
        if path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.socket_path)
            except OSError:
                path.unlink()  # a stale socket left by a dead engine
            else:
                probe.close()
                raise ConfigError(f"another engine is already listening on {self.socket_path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        # Bind under a temporary name and rename once listening: whoever sees the socket file can connect to it.
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(staging))
        listener.listen(16)
        os.replace(staging, path)
        listener.settimeout(_IDLE_WAIT_S)  # so the accept thread notices shutdown
        self._listener = listener

    def _accept_loop(self) -> None:
        while self._listener is not None:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            sock.settimeout(None)
            conn = _Connection(next(self._ids), sock)
            conn.send(self._hello_frame)
            self._inbox.put((conn, _CONNECTED))
            threading.Thread(target=self._read_loop, args=(conn,), name=f"engine-read-{conn.id}", daemon=True).start()
            log.info("connection %d opened", conn.id)

    def _read_loop(self, conn: _Connection) -> None:
        try:
            while True:
                message = p.read_message(conn.sock)
                if message is None:
                    break
                if isinstance(message, p.AddRequest) and message.arrival_time is None:
                    message.arrival_time = time.monotonic()  # waiting for the step boundary is engine queue time
                self._inbox.put((conn, message))
        except (OSError, p.ProtocolError) as exc:
            if conn.alive:
                log.warning("connection %d: %s", conn.id, exc)
        self._inbox.put((conn, None))

    def _hello(self) -> p.Hello:
        engine = self.engine
        config = _plain(engine.stats().get("config") or {})
        return p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            model_name=self.served_model_name or Path(engine.model_dir).name,
            model_dir=str(engine.model_dir),
            max_model_len=int(engine.max_model_len),
            vocab_size=int(engine.vocab_size),
            eos_token_id=engine.eos_token_id,
            num_priority_levels=int(config.get("num_priority_levels", 1)),
            config=config,
            engine_pid=os.getpid(),
            tokenizer_files=self._tokenizer_files,
            eos_token_ids=sorted(engine.eos_token_ids),
            sampling_defaults=dict(engine.sampling_defaults),
            quantization=engine.quantization,
            kernels=getattr(engine.runner, "kernels", ""),
            lora_adapters=engine.loras.snapshot(),
        )

    def _close(self) -> None:
        self._lora_updates.shutdown(wait=False, cancel_futures=True)
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for conn in list(self._connections.values()):
            conn.alive = False
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
                conn.sock.close()
            except OSError:
                pass
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)
        log.info("engine stopped")


# What AutoTokenizer reads from a model folder (whichever exist), capped so Hello stays a reasonable frame.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "config.json",
)  # fmt: skip
_MAX_TOKENIZER_BYTES = 48 * 1024 * 1024


def read_tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    files = {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    if sum(len(data) for data in files.values()) > _MAX_TOKENIZER_BYTES:
        log.warning("tokenizer files of %s are too large to send; sidecars must mount the model folder", model_dir)
        return {}
    return files


def _plain(value):
    """Make stats/config msgpack-friendly: enum keys and values to str, tuples to lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def run_engine_server(
    socket_path: str,
    config_path: str | None = None,
    model: str | None = None,
    overrides: dict[str, Any] | None = None,
    served_model_name: str | None = None,
) -> int:
    """Build the Engine from the config file and flags, then serve it on `socket_path` until SIGTERM."""
    config = load_engine_config(config_path, model, overrides)
    from overlap.engine.core import Engine

    engine = Engine(config)

    def lost(why: str) -> None:  # between steps no collective fails: end the engine here, for a restart
        log.error("%s: the engine cannot step without it; exiting", why)
        time.sleep(2.0)  # a step in flight fails in its collective and answers its requests first
        os._exit(70)

    engine.runner.on_lost(lost)
    grace = float(os.environ.get("OVERLAP_GRACE_PERIOD_S", "30"))
    server = EngineServer(engine, socket_path, grace_period_s=grace, served_model_name=served_model_name)

    def on_signal(signum, _frame) -> None:  # only sets flags: the loop does the work
        if signum == signal.SIGINT:
            server.request_stop()
        server.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.serve_forever()
    return 70 if engine.fatal is not None else 0  # EX_SOFTWARE: the pod (or `overlap serve`) restarts the engine
