"""The engine server in-process (a thread) with a scripted runner: the wire protocol end to end, per-request
errors that keep the connection, stats, reconfigure, per-connection cleanup, drain on stop; and config loading."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import pytest

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.errors import ConfigError
from overlap.engine.serving import protocol as p
from overlap.engine.serving.server import EngineServer, load_engine_config
from overlap.engine.types import RequestSpec, Runner, RunnerOutput, SamplingParams


class CountingRunner(Runner):
    """Token n of every sequence is 100 + n; each step sleeps a little (like a device)."""

    num_kv_blocks, block_size, vocab_size, eos_token_ids, max_model_len = 256, 16, 1000, (2,), 256

    def execute(self, model_input) -> RunnerOutput:
        start = time.perf_counter()
        time.sleep(0.002)
        tokens = [100 + s.num_generated for s in model_input.seqs if s.do_sample]
        return RunnerOutput(tokens, (start, time.perf_counter()))


@contextlib.contextmanager
def serving(engine: Engine, folder):
    """`engine` behind an EngineServer on a thread, at folder/e.sock; stopped (drain, then at once) after."""
    srv = EngineServer(engine, folder / "e.sock", grace_period_s=5)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    for _ in range(100):
        if (folder / "e.sock").exists():
            break
        time.sleep(0.02)
    try:
        yield srv, folder / "e.sock", thread
    finally:
        srv.request_stop()
        srv.request_stop()
        thread.join(5)


@pytest.fixture
def server(tmp_short):
    with serving(Engine(EngineConfig(), runner=CountingRunner(), model_dir=tmp_short), tmp_short) as running:
        yield running


def connect(path) -> tuple[socket.socket, p.Hello]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.settimeout(10)
    hello = p.read_message(sock)
    assert isinstance(hello, p.Hello)
    return sock, hello


def add(sock, request_id: str, prompt: list[int], max_tokens: int) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sock.sendall(p.encode(p.AddRequest.from_record(RequestSpec(request_id, prompt, sampling))))


def collect(sock, request_ids: set[str]) -> dict[str, list]:
    """Messages per request id until every one finished or failed."""
    got: dict[str, list] = {r: [] for r in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        message = p.read_message(sock)
        if isinstance(message, p.Outputs):
            for out in message.outputs:
                got[out.request_id].append(out)
                if out.finished:
                    open_ids.discard(out.request_id)
        elif isinstance(message, p.RequestError):
            got[message.request_id].append(message)
            open_ids.discard(message.request_id)
    return got


def test_hello_requests_errors_stats_and_reconfigure(server):
    _, path, _ = server
    sock, hello = connect(path)
    with sock:
        assert hello.max_model_len == 256 and hello.vocab_size == 1000 and hello.eos_token_id == 2
        assert hello.config["max_num_seqs"] == 64
        add(sock, "a", [5, 6, 7], 5)
        add(sock, "too-long", [5] * 300, 5)  # InvalidRequestError: a per-request error, the connection stays
        add(sock, "b", [8, 9], 3)
        got = collect(sock, {"a", "too-long", "b"})
        assert isinstance(got["too-long"][0], p.RequestError) and "256" in got["too-long"][0].message
        tokens = [t for out in got["a"] for t in out.new_token_ids]
        assert tokens == [100, 101, 102, 103, 104]
        final = got["b"][-1]
        assert final.finish_reason == "length" and final.num_output_tokens == 3 and final.times.finished

        sock.sendall(p.encode(p.StatsRequest(7)))
        reply = p.read_message(sock)
        assert isinstance(reply, p.StatsReply) and reply.seq == 7 and reply.stats["num_connections"] == 1
        knobs = EngineConfig(num_buffers=2).live.replace(max_num_seqs=4, num_buffers=1)
        sock.sendall(p.encode(p.Reconfigure(8, knobs)))
        reply = p.read_message(sock)
        assert reply.seq == 8 and reply.error is None and reply.applied == knobs
        sock.sendall(p.encode(p.StatsRequest(9)))
        assert p.read_message(sock).stats["config"]["num_buffers"] == 1


def test_a_lora_load_reads_its_folder_while_the_steps_go_on_and_updates_reply_in_order(tmp_short):
    """An adapter load whose read takes a while (a large folder, a slow disk: here held until released) does not stop
    the steps: a running request's tokens keep coming meanwhile. An unload sent right after the load waits for it,
    the replies come in the order sent, and a later connection's hello lists what is loaded."""
    release, reading = threading.Event(), threading.Event()

    class SlowDiskRunner(CountingRunner):
        def read_lora(self, name: str, path: str) -> int:
            reading.set()
            assert release.wait(10), "never released"
            return 8

    engine = Engine(EngineConfig(enable_lora=True), runner=SlowDiskRunner(), model_dir=tmp_short)
    with serving(engine, tmp_short) as (_, path, _):
        sock, _ = connect(path)
        try:
            add(sock, "long", [5, 6, 7], 200)
            sock.sendall(p.encode(p.LoraUpdate(1, "tone", "/adapters/tone")))
            sock.sendall(p.encode(p.LoraUpdate(2, "tone", None)))  # the unload, right behind it
            sock.sendall(p.encode(p.LoraUpdate(3, "tone", "/adapters/tone-v2")))
            assert reading.wait(10)
            outputs = 0
            while outputs < 5:  # tokens while the load reads
                message = p.read_message(sock)
                assert isinstance(message, p.Outputs), message
                outputs += len(message.outputs)
            release.set()
            replies = []
            while len(replies) < 3:
                message = p.read_message(sock)
                if isinstance(message, p.LoraUpdateReply):
                    replies.append(message)
            assert [(r.seq, r.error, r.adapters) for r in replies] == [
                (1, None, {"tone": "/adapters/tone"}), (2, None, {}), (3, None, {"tone": "/adapters/tone-v2"})
            ]  # fmt: skip
            later, hello = connect(path)
            later.close()
            assert hello.lora_adapters == {"tone": "/adapters/tone-v2"}
        finally:
            release.set()
            sock.close()


def test_kv_events_report_the_cached_blocks_then_only_changes_and_a_snapshot_for_a_stale_reader(server):
    from overlap.engine.prefix_hash import HASH_SCHEME, STORED, block_hashes

    _, path, _ = server
    sock, _ = connect(path)
    with sock:
        prompt = list(range(10, 50))  # 40 tokens: 2 full blocks of 16, then 4 more generated -> 2 cached blocks
        add(sock, "a", prompt, 4)
        collect(sock, {"a"})
        sock.sendall(p.encode(p.KvEventsRequest(1)))
        first = p.read_message(sock)
        assert isinstance(first, p.KvEventsReply) and first.reset and first.hash_scheme == HASH_SCHEME
        assert first.block_size == 16 and first.load["num_running"] == 0
        assert sorted(h for _, h in first.events) == sorted(block_hashes(prompt, 16))
        sock.sendall(p.encode(p.KvEventsRequest(2, first.next_seq, first.epoch)))
        assert p.read_message(sock).events == []  # nothing changed since
        add(sock, "b", prompt + [7] * 20, 1)  # shares both blocks, adds one more
        collect(sock, {"b"})
        sock.sendall(p.encode(p.KvEventsRequest(3, first.next_seq, first.epoch)))
        delta = p.read_message(sock)
        assert not delta.reset and delta.events == [(STORED, block_hashes(prompt + [7] * 20, 16)[2])]
        sock.sendall(p.encode(p.KvEventsRequest(4, first.next_seq, "another-engine")))
        assert p.read_message(sock).reset


def test_a_closed_connection_aborts_its_requests(server):
    srv, path, _ = server
    sock, _ = connect(path)
    add(sock, "long", [5, 6], 200)
    time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 5
    while srv.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not srv.engine.has_unfinished()
    other, _ = connect(path)  # the server still serves others
    with other:
        add(other, "x", [1], 2)
        assert collect(other, {"x"})["x"][-1].num_output_tokens == 2


def test_stop_drains_in_flight_and_refuses_new(server):
    srv, path, thread = server
    sock, _ = connect(path)
    with sock:
        add(sock, "inflight", [5], 40)
        time.sleep(0.02)
        srv.request_stop()
        add(sock, "late", [5], 2)
        got = collect(sock, {"inflight", "late"})
        assert got["inflight"][-1].num_output_tokens == 40
        assert isinstance(got["late"][0], p.RequestError) and got["late"][0].kind == "shutting_down"
        time.sleep(0.2)
        assert thread.is_alive()  # idle, but a sidecar is still connected (it drains first, then hangs up)
    thread.join(5)
    assert not thread.is_alive() and not path.exists()


def test_engine_config_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"max_num_seqs": 8, "num_buffers": 1}))
    (tmp_path / "b.yaml").write_text("max_num_seqs: 12\naging_s: 2.5\n")
    assert load_engine_config(tmp_path / "a.json").max_num_seqs == 8
    config = load_engine_config(tmp_path / "b.yaml", model="/m")
    assert (config.max_num_seqs, config.aging_s, config.model) == (12, 2.5, "/m")
    (tmp_path / "bad.json").write_text(json.dumps({"max_num_seq": 8}))
    with pytest.raises(ConfigError, match="max_num_seq"):
        load_engine_config(tmp_path / "bad.json")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_engine_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_engine_config(tmp_path / "missing.json")


class BlockingRunner(CountingRunner):
    """Steps like CountingRunner until `hold` is cleared: then a step waits (an engine whose loop hangs)."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.hold.set()

    def execute(self, model_input) -> RunnerOutput:
        self.hold.wait(30)
        return super().execute(model_input)


def _tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_the_engine_probe_passes_on_a_live_engine_and_fails_on_a_missing_or_hung_one(tmp_short, capsys):
    from overlap.engine.serving.probe import main, probe

    path = tmp_short / "e.sock"
    assert "no engine socket" in probe(str(path), timeout_s=1)
    assert main(["--socket", str(path), "--timeout", "1"]) == 1
    assert "engine probe failed: no engine socket" in capsys.readouterr().err
    runner = BlockingRunner()
    engine = Engine(EngineConfig(), runner=runner, model_dir=tmp_short)
    srv = EngineServer(engine, path, grace_period_s=1)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if path.exists():
                break
            time.sleep(0.02)
        assert probe(str(path)) is None and main(["--socket", str(path)]) == 0
        sock, _ = connect(path)
        add(sock, "a", [5, 6, 7], 4)  # a client's request is not disturbed by probes
        assert probe(str(path)) is None
        assert _tokens(collect(sock, {"a"})["a"]) == [100, 101, 102, 103]
        runner.hold.clear()  # the next step hangs: the loop stops answering
        add(sock, "b", [5, 6, 7], 4)
        time.sleep(0.2)
        started = time.monotonic()
        assert "did not answer within 0.5 s" in probe(str(path), timeout_s=0.5)
        assert time.monotonic() - started < 2
        runner.hold.set()
        assert _tokens(collect(sock, {"b"})["b"]) == [100, 101, 102, 103]
        sock.close()
    finally:
        runner.hold.set()
        srv.request_stop()
        srv.request_stop()
        thread.join(5)
