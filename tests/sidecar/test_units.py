"""Unit tests without processes: wire protocol, incremental detokenization and stop strings, admission."""

from __future__ import annotations

import random
import socket

import pytest

from overlap.engine.config import LiveKnobs
from overlap.engine.serving import protocol as p
from overlap.engine.types import FinishReason, RequestOutput, RequestSpec, RequestTimes, SamplingParams, TokenLogprob
from overlap.openai.text import TextProcessor
from overlap.sidecar.admission import Admission
from overlap.sidecar.detokenize import IncrementalDetokenizer


def test_protocol_round_trip_over_a_socket():
    out = RequestOutput("r1", [5, 6], True, FinishReason.LENGTH, 3, 2, 1, RequestTimes(1.0, 1.1, 1.2, 1.3, 1.4, 0))
    spec = RequestSpec("r1", [1, 2, 3], SamplingParams(max_tokens=4, seed=7), priority=0)
    messages = [
        p.AddRequest.from_record(spec),
        p.Abort(["r1", "r2"]),
        p.Reconfigure(3, LiveKnobs(8, 2048, 2, 5.0, None)),
        p.Outputs([p.WireOutput.from_output(out)]),
        p.RequestError("r9", "too long"),
        p.StatsReply(4, {"num_waiting": 1, "config": {"a": None}}),
    ]
    a, b = socket.socketpair()
    with a, b:
        for message in messages:
            a.sendall(p.encode(message))
        a.shutdown(socket.SHUT_WR)
        received = []
        while (message := p.read_message(b)) is not None:
            received.append(message)
    assert received == messages
    back = received[3].outputs[0].to_output()
    assert back == out
    assert received[0].to_record() == spec


def test_a_reconfigure_frame_carries_all_live_knobs_checked_on_arrival():
    """The wire's Reconfigure holds a whole LiveKnobs: a frame with a knob missing, out of range or of another name
    is an undecodable frame, never a partial change."""
    import msgspec

    knobs = LiveKnobs(8, 2048, 2, 5.0, None)
    frame = p.encode(p.Reconfigure(3, knobs))[4:]
    assert p.decode(frame).knobs == knobs

    def with_knobs(fields: dict) -> bytes:  # the same frame, its knobs replaced
        raw = msgspec.msgpack.decode(frame)
        return msgspec.msgpack.encode([fields if isinstance(v, dict) else v for v in raw])

    assert p.decode(with_knobs(knobs.to_dict())).knobs == knobs
    for bad in ({"max_num_seqs": 0}, {"num_buffers": 9}, {"max_num_seqs": "8"}):
        with pytest.raises(p.ProtocolError, match=next(iter(bad))):
            p.decode(with_knobs({**knobs.to_dict(), **bad}))
    with pytest.raises(p.ProtocolError, match="aging_s"):
        p.decode(with_knobs({k: v for k, v in knobs.to_dict().items() if k != "aging_s"}))


def test_every_request_field_crosses_the_wire():
    """Each RequestSpec and SamplingParams field set away from its default survives the wire (a field the wire lacks
    would be silently dropped on the way to the engine), and so does each RequestTimes field."""
    import dataclasses

    params = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=7, seed=3, ignore_eos=True,
                            stop_token_ids=(4, 5), logprobs=2, logit_bias=((11, -3.5),), min_tokens=2,
                            bad_words_ids=((6,), (7, 8)), presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.2, grammar='{"grammars": []}', prompt_logprobs=1)  # fmt: skip
    defaults = SamplingParams()
    assert all(getattr(params, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(SamplingParams))
    spec = RequestSpec(
        "r", [1], params, priority=0, timeout_s=2.5, arrival_time=12.25, share_prompt_with="q", lora_name="sql"
    )
    bare = RequestSpec("", [], defaults)
    assert all(getattr(spec, f.name) != getattr(bare, f.name) for f in dataclasses.fields(RequestSpec))
    wire = p.AddRequest.from_record(spec)
    assert p.decode(p.encode(wire)[p.HEADER_SIZE :]).to_record() == spec
    # by position on the wire: protocol 1's order, so that a field added to the record goes at the end
    assert p.AddRequest.__struct_fields__[:7] == ("request_id", "prompt_token_ids", "sampling", "priority",
                                                  "timeout_s", "arrival_time", "share_prompt_with")  # fmt: skip
    times = RequestTimes(1.0, 1.5, 2.0, 2.5, 3.0, num_preemptions=2)
    out = RequestOutput("r", [5], times=times, logprobs=[TokenLogprob(-0.5, [(5, -0.5), (9, -1.25)])])
    assert p.WireOutput.from_output(out).to_output() == out
    assert p.decode(p.encode(p.Outputs([p.WireOutput.from_output(out)]))[p.HEADER_SIZE :]).outputs[0].to_output() == out


def test_protocol_rejects_a_truncated_or_garbage_frame():
    frame = p.encode(p.Abort(["x"]))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame[:-1])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(p.ProtocolError):
            p.read_message(b)
    with pytest.raises(p.ProtocolError):
        p.decode(b"\x93garbage")
    with pytest.raises(p.ProtocolError):
        p.frame_length(b"\xff\xff\xff\xff")


@pytest.fixture(scope="module")
def text(tiny_model_dir) -> TextProcessor:
    return TextProcessor(tiny_model_dir)


def test_detokenizer_holds_back_split_multibyte_characters(text):
    sample = "héllo wörld, 日本語 and 🎉 done"
    ids = text.encode(sample)
    detok = IncrementalDetokenizer(text, [], [])
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) + detok.flush() == text.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)  # never half a character
    assert "" in pieces  # some token ended mid-character and was held back (the test would be vacuous otherwise)


@pytest.mark.parametrize("stop", [["STOP"], ["beta ST", "a"], ["OP gam", "ta"]])
def test_stop_strings_cut_the_same_text_at_the_same_token_however_the_tokens_are_grouped(text, stop):
    # speculative decoding delivers several tokens at once: the cut, and the token that completed the stop string,
    # must not depend on how they were grouped
    ids = text.encode("alpha beta STOP gamma delta")
    rng = random.Random(0)
    results = set()
    for grouping in range(20):
        detok = IncrementalDetokenizer(text, [], stop)
        shown, consumed, at = "", 0, 0
        while at < len(ids) and not detok.stopped:
            size = 1 if grouping == 0 else rng.randint(1, 5)
            shown += detok.push(ids[at : at + size])
            consumed += detok.tokens_kept
            at += size
        results.add((shown + detok.flush(), detok.stopped, consumed))
    assert len(results) == 1
    ((cut, stopped, consumed),) = results
    assert stopped and consumed < len(ids) and text.decode(ids).startswith(cut)


def test_stop_string_split_across_tokens_is_cut_and_never_shown(text):
    ids = text.encode("alpha beta STOP gamma")
    detok = IncrementalDetokenizer(text, [], ["STOP", "never"])
    shown = ""
    for i in ids:
        shown += detok.push([i])
        if detok.stopped:
            break
    assert detok.stopped
    assert shown + detok.flush() == "alpha beta "
    assert "ST" not in shown


def test_chat_template_is_applied(text):
    ids = text.encode_chat([{"role": "user", "content": "hi"}])
    rendered = text.tokenizer.decode(ids)
    assert rendered.startswith("<s><|user|>\nhi</s>") and rendered.endswith("<|assistant|>\n")


def test_admission_watermarks_and_retry_after():
    adm = Admission(max_queued_requests=2, max_queued_tokens=100, max_inflight=3)
    assert adm.check(10) is None
    adm.admit("a", 10, max_tokens=16)
    adm.admit("b", 10, max_tokens=16)
    rejection = adm.check(10)
    assert rejection.reason == "queued_requests" and rejection.retry_after_s >= 1
    adm.started("a")
    assert adm.check(90) is None  # 10 + 90 tokens queued fits the token watermark
    assert adm.check(91).reason == "queued_tokens"
    adm.admit("c", 5, max_tokens=16)
    assert adm.check(1).reason == "inflight"
    for rid in ("a", "b", "c"):
        adm.finished(rid)
    assert adm.num_inflight == 0 and adm.num_queued == 0 and adm.num_queued_tokens == 0
    assert adm.drain_rate() > 0
    # A prompt bigger than the token watermark still gets in when nothing is queued (else it never would).
    assert Admission(2, 100, 3).check(500) is None


def test_retry_after_is_when_the_requests_in_flight_are_expected_to_finish():
    adm = Admission(max_queued_requests=8, max_queued_tokens=1000, max_inflight=2)
    adm.admit("long", 4, max_tokens=100)
    adm.admit("short", 4, max_tokens=30)
    assert adm.expected_wait_s(1, now=0.0) is None  # nothing started, nothing finished: no estimate
    for rid in ("long", "short"):
        adm.progress(rid, 1, now=10.0)
        adm.progress(rid, 11, now=11.0)  # 10 tokens a second each
    assert adm.expected_wait_s(1, now=11.0) == pytest.approx(1.9)  # short: 19 tokens left
    assert adm.expected_wait_s(2, now=11.0) == pytest.approx(8.9)  # then long: 89 left
    assert adm.check(1).reason == "inflight"
    # Recent requests stopped (at an EOS) after 21 tokens: long is expected to as well, not to run to 100.
    adm.admit("stopped", 4, max_tokens=100)
    adm.progress("stopped", 21, now=11.0)
    adm.finished("stopped")
    assert adm.expected_wait_s(2, now=11.0) == pytest.approx(1.0)
    adm.progress("long", 40, now=13.9)  # past the recent longest: one more token
    assert adm.expected_wait_s(1, now=13.9) == 0.0  # short is overdue: any moment now
    assert adm.expected_wait_s(2, now=13.9) == pytest.approx(0.1)


def test_a_request_without_a_pace_yet_goes_at_the_recent_pace():
    adm = Admission(max_queued_requests=8, max_queued_tokens=1000, max_inflight=1)
    adm.admit("done", 4, max_tokens=50)
    adm.progress("done", 1, now=0.0)
    adm.progress("done", 41, now=2.0)  # 20 tokens a second
    adm.finished("done")
    adm.admit("fresh", 4, max_tokens=30)  # not started: 30 tokens at the recent pace
    assert adm.expected_wait_s(1, now=5.0) == pytest.approx(1.5)
    adm.progress("fresh", 1, now=5.0)  # one token: still no pace of its own
    assert adm.expected_wait_s(1, now=5.5) == pytest.approx(29 * 0.05 - 0.5)


def test_tokenizer_shipped_in_hello_when_the_model_folder_is_not_mounted(tiny_model_dir, text):
    from overlap.engine.serving.server import read_tokenizer_files
    from overlap.sidecar.app import _tokenizer_source

    files = read_tokenizer_files(tiny_model_dir)
    assert "tokenizer.json" in files and "model.safetensors" not in files
    hello = p.Hello(p.PROTOCOL_VERSION, "m", "/nowhere/m", 2048, 8192, 2, 3, {}, tokenizer_files=files)
    source = _tokenizer_source(hello)
    assert source != "/nowhere/m" and _tokenizer_source(hello) == source  # cached by content
    shipped = TextProcessor(source)
    sample = "héllo 日本語"
    assert shipped.encode(sample) == text.encode(sample)
    chat = [{"role": "user", "content": "hi"}]
    assert shipped.encode_chat(chat) == text.encode_chat(chat)
    # Where the folder is visible, it is used directly.
    local = p.Hello(p.PROTOCOL_VERSION, "m", str(tiny_model_dir), 2048, 8192, 2, 3, {}, tokenizer_files=files)
    assert _tokenizer_source(local) == str(tiny_model_dir)


async def test_a_sequence_that_fails_past_the_engine_ends_with_an_error_event_and_its_siblings_go_on():
    """n > 1 streamed: one sequence's generation raising something other than an ApiError (a detokenizer error, say)
    gives that sequence an error event, and the merged stream still ends for the others instead of waiting."""
    import asyncio

    from overlap.sidecar.openai.sequences import Sequence
    from overlap.sidecar.openai.stream import _Merged

    class Generation:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        async def deltas(self):
            if self.fails:
                raise RuntimeError("Invalid prefix encountered")
            return
            yield

    sequences = [Sequence(i, 0, Generation(fails=i == 0), None, i == 0) for i in range(2)]
    merged = _Merged(None, sequences)
    events = [await asyncio.wait_for(merged.next(), 5) for _ in sequences]
    await merged.close()
    ends = {seq.index: error for seq, delta, error in events if delta is None}
    assert ends[1] is None and ends[0].status == 500 and "Invalid prefix encountered" in str(ends[0])


def test_echo_with_logprobs_past_the_prompt_logprobs_cap_is_refused_before_the_engine():
    """Prompt logprobs travel in one frame of the engine's wire protocol: a request whose would overflow it (and
    fail every request of the pod with it) is refused with the sizes; one under the cap passes."""
    from types import SimpleNamespace

    from overlap.openai import schemas
    from overlap.sidecar.openai import request as req
    from overlap.sidecar.state import ApiError

    state = SimpleNamespace(max_model_len=1 << 20, vocab_size=1000, sampling_defaults={})
    body = schemas.CompletionRequest(model="m", prompt="x", logprobs=20, echo=True)
    prompt = req.MAX_PROMPT_LOGPROBS // 21
    assert req.sampling_params(state, body, prompt, 1, echo=True).prompt_logprobs == 20
    with pytest.raises(ApiError, match=r"asks for \d+ prompt logprobs, over this server's 1048576") as refused:
        req.sampling_params(state, body, prompt + 1, 1, echo=True)
    assert refused.value.status == 400
