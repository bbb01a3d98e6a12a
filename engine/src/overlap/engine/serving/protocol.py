"""The engine <-> sidecar wire protocol: msgspec Structs encoded as msgpack, one message per length-prefixed frame,
over a Unix domain socket.

Frame: a 4-byte big-endian payload length, then the msgpack payload. Every message is a tagged Struct (the tag is
its first array element), so one decoder reads any of them. The engine speaks token ids only; text stays in the
sidecar.

    sidecar -> engine: AddRequest, Abort, Reconfigure, StatsRequest, KvEventsRequest
    engine -> sidecar: Hello (first, once per connection), Outputs (many requests per frame), RequestError,
                       ReconfigureReply, StatsReply, KvEventsReply
"""

from __future__ import annotations

import dataclasses
import struct
import typing
from typing import Any

import msgspec

from overlap.engine.config import LiveKnobs
from overlap.engine.types import FinishReason, RequestOutput, RequestSpec, RequestTimes, SamplingParams, TokenLogprob

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a sanity bound: a larger length prefix means a corrupt stream
_HEADER = struct.Struct(">I")
HEADER_SIZE = _HEADER.size


class _Message(msgspec.Struct, array_like=True, tag=True, omit_defaults=True):
    pass


# ---- sidecar -> engine -------------------------------------------------------------------------------------------


def _wire_struct(cls: type, name: str, nested: dict[type, type] | None = None, **options) -> type[msgspec.Struct]:
    """A msgspec Struct with the fields, types and defaults of the dataclass `cls`, converted to and from it by name
    (`Wire.from_record(value)`, `wire.to_record()`): the wire type is generated, never written twice. `nested` maps a
    field's dataclass type to its wire struct. Encoded as a map of the non-default fields unless `options` (msgspec's
    struct options: bases, tag, array_like, forbid_unknown_fields) say otherwise. It holds the values unchecked:
    `to_record` builds the dataclasses, whose own checks raise InvalidRequestError, so the engine can refuse that one
    request by id instead of failing the whole frame."""
    hints = typing.get_type_hints(cls)
    wire_of = {field: nested[kind] for field, kind in hints.items() if nested and kind in nested}
    fields = []
    for f in dataclasses.fields(cls):
        kind = wire_of.get(f.name, hints[f.name])
        if f.default is not dataclasses.MISSING:
            fields.append((f.name, kind, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind))

    def from_record(wire_cls, value):
        values = {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
        return wire_cls(**{f: wire_of[f].from_record(v) if f in wire_of else v for f, v in values.items()})

    def to_record(self):
        values = msgspec.structs.asdict(self)
        return cls(**{f: v.to_record() if f in wire_of else v for f, v in values.items()})

    namespace = {
        "from_record": classmethod(from_record),
        "to_record": to_record,
        "__doc__": f"{cls.__name__} on the wire.",
    }
    return msgspec.defstruct(name, fields, namespace=namespace, **{"omit_defaults": True, **options})


# sidecar -> engine: a request (`AddRequest.from_record(spec)`, `message.to_record()`), its SamplingParams inside
WireSampling = _wire_struct(SamplingParams, "WireSampling", forbid_unknown_fields=True)
AddRequest = _wire_struct(RequestSpec, "AddRequest", {SamplingParams: WireSampling}, bases=(_Message,), tag="add")


class Abort(_Message, tag="abort"):
    request_ids: list[str]


class Reconfigure(_Message, tag="reconf"):
    seq: int
    knobs: LiveKnobs  # all of them: what the engine runs from its next step on


class LoraUpdate(_Message, tag="lora"):
    """Load LoRA adapter `name` from folder `path`, or (path None) unload it: its running requests finish first.
    `replace`: a name already loaded moves to `path` once that folder reads (else it is refused)."""

    seq: int
    name: str
    path: str | None = None
    replace: bool = False


class StatsRequest(_Message, tag="stats?"):
    seq: int


class KvEventsRequest(_Message, tag="kv?"):
    """The prefix cache's changes after event number `since` of engine `epoch` (a snapshot if that is not this
    engine's, or too old), and the engine's load."""

    seq: int
    since: int = 0
    epoch: str = ""


# ---- engine -> sidecar -------------------------------------------------------------------------------------------


class Hello(_Message, tag="hello"):
    protocol_version: int
    model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    num_priority_levels: int
    config: dict[str, Any]
    engine_pid: int = 0
    # The tokenizer files of the model folder, so a sidecar container without the model volume can still
    # tokenize (file name -> content; empty when they are too large to ship).
    tokenizer_files: dict[str, bytes] = {}
    eos_token_ids: list[int] = []  # every EOS id the model declares (eos_token_id is the first)
    # generation_config.json's temperature / top_p / top_k: what a request that leaves them out gets
    sampling_defaults: dict[str, float] = {}
    quantization: str = ""  # the checkpoint's quantization format ("" for float weights)
    kernels: str = ""  # what runs the step's work on this machine (ModelRunner.kernels)
    lora_adapters: dict[str, str] = {}  # LoRA adapter name -> folder, the names a request's model may give


WireTimes = _wire_struct(RequestTimes, "WireTimes", array_like=True)


class WireOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    times: WireTimes | None = None
    error: str | None = None
    # Per new token: (its logprob, [[token id, logprob], ...] most likely first), or None where the runner had none.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None

    @classmethod
    def from_output(cls, out: RequestOutput, request_id: str | None = None) -> WireOutput:
        times = None if out.times is None else WireTimes.from_record(out.times)
        return cls(
            request_id=out.request_id if request_id is None else request_id,
            new_token_ids=list(out.new_token_ids),
            finished=out.finished,
            finish_reason=None if out.finish_reason is None else str(out.finish_reason),
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens,
            times=times,
            error=out.error,
            logprobs=_wire_logprobs(out.logprobs),
            prompt_logprobs=_wire_logprobs(out.prompt_logprobs),
        )

    def to_output(self) -> RequestOutput:
        times = None if self.times is None else self.times.to_record()
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids,
            finished=self.finished,
            finish_reason=None if self.finish_reason is None else FinishReason(self.finish_reason),
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            times=times,
            error=self.error,
            logprobs=_engine_logprobs(self.logprobs),
            prompt_logprobs=_engine_logprobs(self.prompt_logprobs),
        )


def _wire_logprobs(logprobs: list[TokenLogprob | None] | None):
    if logprobs is None:
        return None
    return [None if lp is None else (lp.logprob, lp.top) for lp in logprobs]


def _engine_logprobs(logprobs) -> list[TokenLogprob | None] | None:
    if logprobs is None:
        return None
    return [None if lp is None else TokenLogprob(lp[0], [(int(t), float(v)) for t, v in lp[1]]) for lp in logprobs]


class Outputs(_Message, tag="out"):
    outputs: list[WireOutput]


class RequestError(_Message, tag="reqerr"):
    """add_request refused this request (InvalidRequestError, or the engine is shutting down): it never started."""

    request_id: str
    message: str
    kind: str = "invalid_request"  # invalid_request | unknown_adapter | shutting_down | internal


class ReconfigureReply(_Message, tag="reconf!"):
    seq: int
    applied: LiveKnobs | None = None  # what the engine runs after the change
    error: str | None = None  # ConfigError message when nothing was applied


class LoraUpdateReply(_Message, tag="lora!"):
    seq: int
    adapters: dict[str, str] = {}  # LoRA adapter name -> folder, after the change
    error: str | None = None  # why nothing changed
    not_found: bool = False  # the error is an unload of a name not loaded


class StatsReply(_Message, tag="stats!"):
    seq: int
    stats: dict[str, Any]


class KvEventsReply(_Message, tag="kv!"):
    seq: int
    epoch: str
    block_size: int
    hash_scheme: str
    next_seq: int  # the `since` of the next request
    reset: bool  # events is a snapshot: forget what this engine said before
    events: list[tuple[int, int]]  # (+1 stored / -1 evicted, block hash), in order
    load: dict[str, Any]  # num_waiting, num_running, kv_usage


Message = (
    AddRequest
    | Abort
    | Reconfigure
    | LoraUpdate
    | StatsRequest
    | KvEventsRequest
    | Hello
    | Outputs
    | RequestError
    | ReconfigureReply
    | LoraUpdateReply
    | StatsReply
    | KvEventsReply
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(Exception):
    """The byte stream is not a valid frame sequence (a peer bug or a corrupt stream)."""


def encode(message: Message) -> bytes:
    """One frame: length prefix + msgpack payload."""
    payload = _encoder.encode(message)
    return _HEADER.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte bound")
    return length


def decode(payload: bytes) -> Message:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc


def read_message(sock) -> Message | None:
    """Read one message from a blocking socket; None at a clean end of stream."""
    header = _recv_exactly(sock, HEADER_SIZE)
    if header is None:
        return None
    payload = _recv_exactly(sock, frame_length(header))
    if payload is None:
        raise ProtocolError("connection closed in the middle of a frame")
    return decode(payload)


def _recv_exactly(sock, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ProtocolError("connection closed in the middle of a frame")
            return None
        buf += chunk
    return bytes(buf)


async def read_message_async(reader) -> Message | None:
    """Read one message from an asyncio StreamReader; None at a clean end of stream."""
    import asyncio

    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ProtocolError("connection closed in the middle of a frame") from exc
        return None
    try:
        payload = await reader.readexactly(frame_length(header))
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("connection closed in the middle of a frame") from exc
    return decode(payload)
