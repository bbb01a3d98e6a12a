"""`overlap router`: its index and scores as units, then the real thing: two `overlap serve` replicas (real engines,
the tiny model, LoRA on) behind an `overlap router` process, driven over HTTP: a prompt goes where its prefix is
cached (the router computes the block hashes the engines publish), a session stays put, a LoRA adapter's requests
go where it is served and loaded, the tokenizer comes from a replica, a replica killed under load loses nothing,
and a router that finds its replicas by DNS name holds requests until one is ready."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import msgspec
import pytest

from overlap.engine.prefix_hash import HASH_SCHEME, REMOVED, STORED
from overlap.gateway.router.app import Router, RouterConfig
from overlap.gateway.router.picker import Pick, Picker, PrefixIndex, ReplicaState
from overlap.openai import schemas
from overlap.openai.text import TextProcessor
from tests.support.lora import make_adapter
from tests.support.sidecar import Proc, free_port, http, metric_value, overlap_cmd, overlap_serve, wait_until


# ---- units -------------------------------------------------------------------------------------------------------
def test_the_index_counts_each_replicas_leading_blocks_and_forgets_evicted_ones():
    index = PrefixIndex()
    index.apply("a", [(STORED, 1), (STORED, 2), (STORED, 3)], reset=True)
    index.apply("b", [(STORED, 1), (STORED, 3)], reset=True)  # 3 without 2 is no prefix of [1, 2, 3]
    assert index.matches([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    index.apply("a", [(REMOVED, 2)], reset=False)
    assert index.matches([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 1}
    index.apply("a", [(STORED, 9)], reset=True)  # a snapshot replaces what the replica held
    assert index.matches([1], ["a"]) == {"a": 0} and len(index) == 3
    index.drop("b")
    assert index.matches([1], ["b"]) == {"b": 0} and len(index) == 1


def test_router_side_tracking_keeps_the_most_recent_blocks_per_replica():
    index = PrefixIndex(capacity=3)
    index.record("a", [1, 2, 3])
    index.record("a", [1, 4])  # 1 refreshed, 2 the oldest: out
    assert index.matches([1, 2], ["a"]) == {"a": 1} and index.matches([3, 1, 4], ["a"]) == {"a": 3}


def test_the_prefix_policy_weighs_cached_tokens_against_backlogs_and_keeps_sessions():
    a, b = ReplicaState("a", ready=True), ReplicaState("b", ready=True)
    picker = Picker("prefix", seed=0)  # U, the mean uncached prompt, starts at 256 tokens
    picker.index.apply("a", [(STORED, h) for h in range(64)], reset=True)
    prompt = list(range(64))  # 64 blocks of 16: 1024 tokens, all cached on a
    assert picker.pick([a, b], prompt, 16, 1024).replica is a
    a.starting, a.backlog_tokens = 3, 900  # a prefill backlog on a: still less than recomputing 1024 tokens on b
    assert picker.pick([a, b], prompt, 16, 1024).reason == "prefix"
    a.backlog_tokens = 1100  # now more: the prompt moves
    assert picker.pick([a, b], prompt, 16, 1024) == Pick(b, "load", 0)
    a.starting = a.backlog_tokens = 0
    a.load = {"kv_usage": 0.99, "num_waiting": 0}  # a full KV cache costs 4 U
    assert picker.pick([a, b], prompt[:8], 16, 128).replica is b
    a.load = {"num_waiting": 2}  # requests from elsewhere waiting on a: U each
    assert picker.pick([a, b], prompt[:8], 16, 128).replica is b
    a.load = {}
    first = picker.pick([a, b], [], 16, 3, session="s1")
    picker.routed(first, [], 16, 3, "s1")
    other = b if first.replica is a else a
    first.replica.in_flight = 1  # streaming: its session outweighs its decode
    assert picker.pick([a, b], [], 16, 3, session="s1") == Pick(first.replica, "session", 0)
    assert picker.pick([a, b], [], 16, 3).replica is other
    with pytest.raises(ValueError, match="policy"):
        Picker("closest")


def test_an_adapters_requests_go_where_it_is_served_and_stay_where_it_is_loaded_until_that_costs_more():
    a, b = ReplicaState("a", ready=True), ReplicaState("b", ready=True)
    picker = Picker("prefix", seed=0)  # U = 256 tokens
    b.set_models([{"id": "base"}, {"id": "sql", "parent": "base"}])
    a.in_flight = 3  # busier, but a does not serve sql (it would answer 404): b
    assert picker.pick([a, b], [], 16, 64, adapter="sql") == Pick(b, "only", 0)
    assert picker.pick([a, b], [], 16, 64, adapter="chat").replica is b  # served nowhere: by the score alone

    a.set_models(b.models)
    first = picker.pick([a, b], [], 16, 64, adapter="sql")  # loaded nowhere: the least loaded
    assert first == Pick(b, "load", 0, adapter_loaded=False)
    picker.routed(first, [], 16, 64, None, adapter="sql")
    a.in_flight = 0
    b.in_flight = 2  # two streams on b cost less than loading sql on a (one U): it stays
    assert picker.pick([a, b], [], 16, 64, adapter="sql") == Pick(b, "adapter", 0, adapter_loaded=True)
    assert picker.pick([a, b], [], 16, 64).replica is a  # the base model goes by load
    b.starting, b.backlog_tokens = 1, 400  # now b's backlog costs more than loading it on a: it moves
    assert picker.pick([a, b], [], 16, 64, adapter="sql") == Pick(a, "load", 0, adapter_loaded=False)
    a.adapter_requests = {"sql": 1}  # a request for sql running on a: loaded there too
    assert picker.pick([a, b], [], 16, 64, adapter="sql").adapter_loaded


def test_one_failed_poll_keeps_a_replicas_index_and_the_second_in_a_row_drops_it():
    """A poll that times out on a loaded machine must not send a live replica's prefixes elsewhere: the replica stays
    ready with its blocks until a second poll in a row fails; a good poll in between starts the count again."""
    url = "http://127.0.0.1:9"
    router = Router(RouterConfig(replicas=[url]))
    state = router.replicas[url] = ReplicaState(url)
    good = {"hash_scheme": HASH_SCHEME, "epoch": "e1", "block_size": 16, "load": {}, "ready": True}
    models = {"data": [{"id": "base"}, {"id": "sql", "parent": "base"}]}
    router._polled(state, {**good, "events": [(STORED, 1), (STORED, 2)], "reset": True, "next_seq": 2}, models)
    assert state.ready and router.picker.index.matches([1, 2], [url]) == {url: 2} and state.adapters == {"sql"}

    router._polled(state, None)  # one failed poll: nothing changes, the next poll goes on from the same event
    assert state.ready and state.failed_polls == 1 and router.ready.is_set() and state.adapters == {"sql"}
    assert router.picker.index.matches([1, 2], [url]) == {url: 2} and (state.epoch, state.next_seq) == ("e1", 2)

    router._polled(state, {**good, "events": [(STORED, 3)], "reset": False, "next_seq": 3})  # a good one resets
    assert state.failed_polls == 0 and router.picker.index.matches([1, 2, 3], [url]) == {url: 3}
    router._polled(state, None)
    assert state.ready and router.picker.index.matches([1, 2, 3], [url]) == {url: 3}

    router._polled(state, None)  # the second in a row: down, its blocks out of the index, a snapshot next
    assert not state.ready and not router.ready.is_set() and len(router.picker.index) == 0 and not state.adapters
    assert (state.epoch, state.next_seq) == ("", 0)
    router._polled(state, {**good, "events": [(STORED, 1)], "reset": True, "next_seq": 4})
    assert state.ready and state.failed_polls == 0 and router.picker.index.matches([1, 2], [url]) == {url: 1}


async def test_an_adapter_unloaded_since_the_last_poll_is_retried_where_it_is_still_served():
    """Replica a unloaded adapter `tone` after its last poll (its API answers 404 model_not_found, as the sidecar
    does) while b still serves it: each request for `tone` ends on b, none gets a's 404; a request for an adapter
    no replica serves still gets the replica's 404."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    answered = {"a": 0, "b": 0}

    def replica(name: str, serves_tone: bool) -> web.Application:
        async def kv_events(request):
            return web.json_response({"hash_scheme": HASH_SCHEME, "epoch": name, "block_size": 16, "load": {},
                                      "ready": True, "events": [], "reset": True, "next_seq": 0})  # fmt: skip

        async def models(request):  # both still list it: a's poll came before its unload
            return web.json_response({"data": [{"id": "base"}, {"id": "tone", "parent": "base", "root": "/t"}]})

        async def completions(request):
            answered[name] += 1
            model = (await request.json())["model"]
            if model == "tone" and serves_tone:
                return web.json_response({"model": "tone", "served_by": name})
            error = {"message": f"no LoRA adapter {model!r} is loaded", "code": "model_not_found"}
            return web.json_response({"error": error}, status=404)

        app = web.Application()
        app.router.add_get("/v1/kv-events", kv_events)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        return app

    async with TestServer(replica("a", False)) as a, TestServer(replica("b", True)) as b:
        urls = [str(a.make_url("")).rstrip("/"), str(b.make_url("")).rstrip("/")]
        router = Router(RouterConfig(replicas=urls, policy="round-robin", poll_interval_s=30))
        async with TestServer(router.build_app()) as server, aiohttp.ClientSession() as client:
            await asyncio.wait_for(router.ready.wait(), 10)
            for _ in range(2):  # round-robin: one of the two picks a first
                router.replicas[urls[0]].adapters = frozenset({"tone"})  # as its last poll listed it
                async with client.post(server.make_url("/v1/completions"), json={"model": "tone", "prompt": "x"}) as r:
                    assert r.status == 200 and (await r.json())["served_by"] == "b"
            assert answered["a"] >= 1 and answered["b"] == 2
            async with client.post(server.make_url("/v1/completions"), json={"model": "nowhere", "prompt": "x"}) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


# ---- the processes ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    config = json.dumps({"num_kv_blocks": 256, "max_num_seqs": 8, "num_threads": 1})
    lora = ("--enable-lora", "--max-lora-rank", "4", "--allow-runtime-lora-updating", "true")
    workdir = Path(tempfile.mkdtemp(prefix="ovl-router-"))
    with ExitStack() as stack:
        replicas = [stack.enter_context(overlap_serve(tiny_model_dir, "engine.json", config, *lora)) for _ in range(2)]
        port = free_port()
        cmd = overlap_cmd("router", "--port", str(port), "--poll-interval-s", "0.05",
                          *[a for r in replicas for a in ("--replica", r["url"])])  # fmt: skip
        router = Proc(cmd, workdir / "router.log")
        stack.callback(router.stop, 30)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http("GET", f"{url}/readyz", timeout=2)[0] == 200, 60, "router ready", router)
        yield {"url": url, "replicas": replicas, "router": router, "model": replicas[0]["model"], "dir": workdir}
    shutil.rmtree(workdir, ignore_errors=True)


def complete(fleet, prompt, headers=None, max_tokens=4, model=None) -> dict:
    body = {"model": model or fleet["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, _, answer = http("POST", f"{fleet['url']}/v1/completions", body, headers=headers, timeout=60)
    assert status == 200, answer
    return answer


PICKS = ("prefix", "session", "load", "only")  # the reasons a pick of the prefix policy gives


def router_metric(fleet, name, labels="") -> float:
    return metric_value(http("GET", f"{fleet['url']}/metrics")[2], name, labels) or 0.0


def replica_metric(replica, name, labels="") -> float:
    return metric_value(http("GET", f"{replica['url']}/metrics")[2], name, labels) or 0.0


def prefix_hits(replica) -> float:
    return replica_metric(replica, "overlap_prompt_cached_tokens_total")


def test_a_prompt_goes_where_its_prefix_is_cached_with_the_tokenizer_from_a_replica(fleet):
    wait_until(lambda: "tokenizer loaded" in fleet["router"].output(), 60, "the router's tokenizer", fleet["router"])
    status, _, error = http("GET", f"{fleet['replicas'][0]['url']}/v1/kv-events?since=soon")
    assert status == 400 and error["error"]["param"] == "since"
    story = " ".join(f"In chapter {i} the river turned north past the mill." for i in range(12))
    complete(fleet, story)
    wait_until(lambda: router_metric(fleet, "overlap_router_index_blocks") > 0, 10, "the blocks in the index")
    before = [prefix_hits(r) for r in fleet["replicas"]]
    hits_before = router_metric(fleet, "overlap_router_prefix_hit_tokens_total")
    picks_before = {why: router_metric(fleet, "overlap_router_picks_total", f'reason="{why}"') for why in PICKS}
    for turn in range(3):
        complete(fleet, story + f" Then, on day {turn}, it rained.")
    gained = [prefix_hits(r) - b for r, b in zip(fleet["replicas"], before, strict=True)]
    assert sorted(gained)[0] == 0 and sorted(gained)[1] > 0  # every turn on the replica holding the story
    assert router_metric(fleet, "overlap_router_prefix_hit_tokens_total") - hits_before >= 3 * 64
    picks = {why: router_metric(fleet, "overlap_router_picks_total", f'reason="{why}"') - n
             for why, n in picks_before.items()}  # fmt: skip
    # every pick by prefix, even on a loaded machine: one timed-out poll keeps a replica and its blocks in the index
    assert picks == {"prefix": 3, "session": 0, "load": 0, "only": 0}, picks


def test_a_session_header_keeps_a_conversation_on_one_replica(fleet):
    def finished():
        return [replica_metric(r, "overlap_requests_finished_total", 'reason="length"') for r in fleet["replicas"]]

    before = finished()
    for i in range(4):
        complete(fleet, [5 + i, 6, 7], headers={"x-session-id": "conversation-1"})
    assert sorted(a - b for a, b in zip(finished(), before, strict=True)) == [0, 4]


def test_an_adapters_requests_go_to_the_replica_that_serves_it_and_then_stay_where_it_is_loaded(fleet, tiny_model_dir):
    """sql is loaded into the second replica only: its requests all go there (the first replica would answer 404),
    hashed through the adapter as the engine hashes them; chat, on both and loaded on neither, goes to one of them
    and its later requests follow. The router's /v1/models lists what the replicas serve."""
    folder = make_adapter(tiny_model_dir, fleet["dir"] / "sql", 4, 8, False, ["q_proj", "v_proj"], seed=3)
    first, second = fleet["replicas"]
    for replica, names in ((second, ("sql", "chat")), (first, ("chat",))):
        for name in names:
            status, _, body = http("POST", f"{replica['url']}/v1/load_lora_adapter",
                                   {"lora_name": name, "lora_path": str(folder)})  # fmt: skip
            assert status == 200, body

    def listed():
        status, _, body = http("GET", f"{fleet['url']}/v1/models")
        return {m["id"]: m.get("parent") for m in body["data"]} if status == 200 else {}

    wait_until(lambda: listed() == {fleet["model"]: None, "sql": fleet["model"], "chat": fleet["model"]}, 10,
               "the adapters in the router's /v1/models", fleet["router"])  # fmt: skip

    def finished():
        return [replica_metric(r, "overlap_requests_finished_total", 'reason="length"') for r in fleet["replicas"]]

    def adapter_requests(loaded):
        return router_metric(fleet, "overlap_router_adapter_requests_total", f'loaded="{loaded}"')

    before, hits_before = finished(), router_metric(fleet, "overlap_router_prefix_hit_tokens_total")
    loaded_before = (adapter_requests("true"), adapter_requests("false"))
    story = " ".join(f"Row {i} of the ledger lists a barrel of salt." for i in range(10))
    assert complete(fleet, story, model="sql")["model"] == "sql"
    wait_until(lambda: router_metric(fleet, "overlap_router_index_blocks") > 0, 10, "the blocks in the index")
    for turn in range(2):
        complete(fleet, story + f" Then {turn}.", model="sql")
    assert [a - b for a, b in zip(finished(), before, strict=True)] == [0, 3]
    # the router's hashes through the adapter are the engine's: the story's blocks were found on the replica
    assert router_metric(fleet, "overlap_router_prefix_hit_tokens_total") - hits_before >= 2 * 64
    assert (adapter_requests("true") - loaded_before[0], adapter_requests("false") - loaded_before[1]) == (2, 1)

    before = finished()
    for i in range(3):
        complete(fleet, [21, i + 3, 4], model="chat")
    assert sorted(a - b for a, b in zip(finished(), before, strict=True)) == [0, 3]
    status, _, error = http("POST", f"{fleet['url']}/v1/completions", {"model": "nowhere", "prompt": "x"})
    assert status == 404 and error["error"]["code"] == "model_not_found"  # the replica's words


def test_a_replica_killed_under_load_loses_nothing(fleet):
    """Requests in flight on the killed replica fail with it (the engine is gone); every later request is retried
    or routed elsewhere: all of those succeed."""
    doomed = fleet["replicas"][1]
    with ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda i: complete(fleet, [9, i % 50 + 3, 4]), range(16)))
        assert len(warm) == 16
        doomed["proc"].stop(60)
        answers = list(pool.map(lambda i: complete(fleet, [11, i % 50 + 3, 4]), range(24)))
    assert len(answers) == 24 and all(a["choices"][0]["finish_reason"] for a in answers)
    status, _, ready = http("GET", f"{fleet['url']}/readyz")
    assert status == 200 and ready["replicas"][doomed["url"]]["ready"] is False


def test_a_router_holds_requests_until_a_replica_of_its_dns_name_is_ready(tiny_model_dir, tmp_path):
    """`--replicas-from localhost:PORT` before anything listens there: the router is up (its health answers), not
    ready, and holds a request (overlap_router_held_requests) until a replica starts on that port; past
    --hold-timeout-s a request gets a 503 that says why."""
    replica_port, port, impatient_port = free_port(), free_port(), free_port()
    router = Proc(overlap_cmd("router", "--port", str(port), "--replicas-from", f"localhost:{replica_port}",
                              "--resolve-interval-s", "0.2"), tmp_path / "router.log")  # fmt: skip
    impatient = Proc(overlap_cmd("router", "--port", str(impatient_port), "--replica", "http://127.0.0.1:9",
                                 "--hold-timeout-s", "0.3"), tmp_path / "impatient.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    body = {"model": tiny_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 2}
    try:
        for proc, p in ((router, port), (impatient, impatient_port)):
            wait_until(lambda p=p: http("GET", f"http://127.0.0.1:{p}/router/healthz", timeout=2)[0] == 200, 60,
                       "the router's health", proc)  # fmt: skip
        status, _, error = http("POST", f"http://127.0.0.1:{impatient_port}/v1/completions", body)
        assert status == 503 and "no replica became ready within 0.3 s" in error["error"]["message"]
        assert http("GET", f"{url}/readyz")[0] == 503
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(http, "POST", f"{url}/v1/completions", body, None, 300)
            wait_until(lambda: metric_value(http("GET", f"{url}/metrics")[2], "overlap_router_held_requests") == 1,
                       30, "the request held", router)  # fmt: skip
            config = json.dumps({"num_kv_blocks": 256, "max_num_seqs": 4, "num_threads": 1})
            with overlap_serve(tiny_model_dir, "engine.json", config, port=replica_port):
                status, _, answer = held.result(timeout=120)
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert f"replica http://127.0.0.1:{replica_port} added" in router.output()  # found by the name
    finally:
        router.stop(30)
        impatient.stop(30)


def test_a_keyed_router_reads_keyed_replicas_and_requires_the_key_of_clients(tiny_model_dir, tmp_path, monkeypatch):
    """The router and a replica given the same --api-key-env (the operator's pods and router with
    sidecar.apiKeySecret): the router's polls of /v1/kv-events and /v1/models and its tokenizer fetch carry the key,
    so the replica reads as ready; a client without the key gets the sidecar's 401 from the router itself (its
    /v1/models included), one with it the replica's answer. `overlap serve` names its model with the key too."""
    monkeypatch.setenv("TEST_OVERLAP_KEY", "s3cret")
    config = json.dumps({"num_kv_blocks": 256, "max_num_seqs": 4, "num_threads": 1})
    with overlap_serve(tiny_model_dir, "engine.json", config, "--api-key-env", "TEST_OVERLAP_KEY") as replica:
        port = free_port()
        router = Proc(overlap_cmd("router", "--port", str(port), "--replica", replica["url"],
                                  "--api-key-env", "TEST_OVERLAP_KEY"), tmp_path / "router.log")  # fmt: skip
        url, key = f"http://127.0.0.1:{port}", {"Authorization": "Bearer s3cret"}
        try:
            wait_until(lambda: http("GET", f"{url}/readyz", timeout=2)[0] == 200, 60, "the replica read", router)
            wait_until(lambda: "tokenizer loaded" in router.output(), 60, "the router's tokenizer", router)
            body = {"model": replica["model"], "prompt": "The river", "max_tokens": 2}
            # `overlap serve` read its model's name with the key too (no 401 on its own count)
            assert f"(model {replica['model']}," in replica["proc"].output()
            assert replica_metric(replica, "overlap_requests_rejected_total", 'reason="unauthorized"') == 0
            for headers in (None, {"Authorization": "Bearer wrong"}):
                status, _, error = http("POST", f"{url}/v1/completions", body, headers=headers)
                assert status == 401 and error["error"]["code"] == "invalid_api_key"
                assert http("GET", f"{url}/v1/models", headers=headers)[0] == 401
            status, _, models = http("GET", f"{url}/v1/models", headers=key)
            assert status == 200 and [m["id"] for m in models["data"]] == [replica["model"]]
            status, _, answer = http("POST", f"{url}/v1/completions", body, headers=key, timeout=60)
            assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
            assert replica_metric(replica, "overlap_requests_finished_total", 'reason="length"') == 1
            # the router refused them itself: none reached the replica
            assert replica_metric(replica, "overlap_requests_rejected_total", 'reason="unauthorized"') == 0
        finally:
            router.stop(30)


def test_a_chat_request_is_scored_on_the_tokens_the_replica_will_see(tiny_model_dir):
    """Content given as text parts and an assistant's tool call count as the sidecar renders them: the router
    scores the same token ids the replica's prefix cache will hold."""
    router = Router(RouterConfig(replicas=["http://127.0.0.1:9"]))
    router.text = TextProcessor(str(tiny_model_dir))
    assert router.text.has_chat_template
    call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    body = {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Always."}]},
        {"role": "user", "content": "Where is the mill?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "north"},
    ]}  # fmt: skip
    tokens = asyncio.run(router.prompt_tokens_of("/v1/chat/completions", body))
    rendered = schemas.chat_messages_as_dicts(msgspec.convert(body, schemas.ChatCompletionRequest).messages)
    assert rendered[0]["content"] == "Be brief. Always."
    assert tokens == router.text.encode_chat(rendered, True, False, None) and len(tokens) > 10
    bad = {**body, "messages": [{"role": "narrator", "content": "x"}]}  # the replica refuses it: no score
    assert asyncio.run(router.prompt_tokens_of("/v1/chat/completions", bad)) == []
