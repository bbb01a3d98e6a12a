"""The replay runner: bounded runs on the simulated device, one small real replay on the tiny model, and the
OpenAI streaming client against a fake endpoint."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import pytest
from aiohttp import web

from overlap.bench import replay, replay_endpoint, workload
from overlap.bench.report import compute_metrics
from overlap.bench.traces import Trace, TraceError, TraceRequest


def burst_trace(n: int, spacing_s: float, max_tokens: int) -> Trace:
    return Trace(tuple(TraceRequest(i * spacing_s, max_tokens, prompt_tokens=8) for i in range(n)), "test")


def sim_run(policy: str, trace: Trace, drain_s: float, args=None):
    engine, _ = replay.build_engine(policy, args or {}, 64, None, sim_cost=(5.0, 20.0))
    config = {"batching": policy, "max_num_seqs": 64}
    return replay.replay_in_process(trace, engine, policy, config, drain_s, progress=False)


def test_policy_args_and_specs():
    assert replay.parse_policy_args("max_batch=16, max_wait_ms=100") == {"max_batch": 16, "max_wait_ms": 100}
    with pytest.raises(TraceError, match="expected key=value"):
        replay.parse_policy_args("max_batch")
    with pytest.raises(TraceError, match="must be a number"):
        replay.parse_policy_args("max_batch=lots")
    with pytest.raises(TraceError, match="unknown policy"):
        replay.make_specs(["greedy"], [], None)
    specs, notes = replay.make_specs(["dynamic"], ["http://x:1/"], {"max_batch": 4}, rate=100)
    assert specs[0].label == "dynamic(max_batch=4, max_wait_ms=150)"  # explicit arguments win over the advisor
    assert specs[1].target == "http://x:1" and notes == []
    named = replay.make_specs([], ["vllm=http://127.0.0.1:8011/"], None)[0][0]
    assert (named.label, named.target) == ("vllm", "http://127.0.0.1:8011")
    with pytest.raises(TraceError, match="expected a URL"):
        replay.make_specs([], ["vllm=localhost"], None)


def test_dynamic_defaults_follow_the_advisor_for_the_trace_rate():
    # 100 req/s, 1 s SLO: a 500 ms wait budget holds 50 arrivals; filling 50 takes 500 ms
    specs, notes = replay.make_specs(["fixed_window", "dynamic"], [], None, rate=100, slo_ms=1000, max_num_seqs=64)
    assert specs[0].policy_args == {"window_ms": 50}
    assert specs[1].policy_args == {"max_batch": 50, "max_wait_ms": 500}
    assert len(notes) == 1 and "--rate 100.0 --slo-ms 1000" in notes[0] and "max_batch = floor(50.00) = 50" in notes[0]
    # the sequence cap bounds the batch, and the wait shrinks to the time it takes to fill it
    capped, _ = replay.make_specs(["dynamic"], [], None, rate=400, slo_ms=1000, max_num_seqs=64)
    assert capped[0].policy_args == {"max_batch": 64, "max_wait_ms": 160}
    # without a rate: field report 2's fixed setting
    assert replay.make_specs(["dynamic"], [], None)[0][0].policy_args == {"max_batch": 8, "max_wait_ms": 150}


def test_prompt_ids_are_the_same_for_every_policy_and_fit_the_context():
    request = TraceRequest(0.0, 4, prompt_tokens=12)
    ids = workload.prompt_token_ids(request, 3, seed=0, vocab_size=8192)
    assert ids == workload.prompt_token_ids(request, 3, seed=0, vocab_size=8192)
    assert len(ids) == 12 and all(10 <= t < 1000 for t in ids)
    tokens, max_tokens = workload.fit_to_context(list(range(100)), 80, max_model_len=64)
    assert max_tokens == 32 and len(tokens) + max_tokens <= 64


def test_serial_run_is_bounded_and_reports_unfinished_requests():
    # 40 requests in 0.4 s; serially each takes 10 decode steps of ~5 ms: far more than the 0.3 s drain allows
    trace = burst_trace(40, 0.01, 10)
    run = sim_run("serial", trace, drain_s=0.3)
    assert run.wall_s < trace.duration_s + 0.3 + 0.5
    m = compute_metrics(run)
    assert m.num_unfinished > 10
    assert m.num_finished + m.num_unfinished == 40
    assert m.mean_batch == pytest.approx(1.0)
    assert 0.5 < m.device_busy_share <= 1.0
    done = [r for r in run.records if r.status == "finished"]
    assert all(r.arrived <= r.first_scheduled <= r.first_token <= r.finished for r in done)
    assert all(len(r.token_times) == 10 for r in done)


def test_continuous_beats_serial_on_the_simulated_device():
    trace = burst_trace(30, 0.01, 10)
    serial = compute_metrics(sim_run("serial", trace, drain_s=1.0))
    continuous = compute_metrics(sim_run("continuous", trace, drain_s=1.0))
    assert continuous.num_finished == 30
    assert continuous.requests_per_s > 3 * serial.requests_per_s
    assert continuous.e2e_p99_ms < serial.e2e_p99_ms


def _dispatch_groups(run) -> list[list[float]]:
    """Arrival offsets of the requests admitted together (same first-scheduled instant), in dispatch order."""
    groups: dict[float, list[float]] = {}
    for r in run.records:
        groups.setdefault(r.first_scheduled, []).append(r.arrived)
    return [sorted(groups[t]) for t in sorted(groups)]


def test_fixed_window_dispatches_one_window_of_arrivals_per_batch_through_the_engine():
    # ~85 req/s for 0.6 s; a batch of 10 output tokens runs ~55 ms on the simulated device, longer than a window
    trace = burst_trace(50, 0.0117, 10)
    run = sim_run("fixed_window", trace, drain_s=2.0, args={"window_ms": 50})
    assert compute_metrics(run).num_finished == 50
    groups = _dispatch_groups(run)
    assert len(groups) < 25 and max(len(g) for g in groups) >= 3  # real batches, not one at a time
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # oldest window first

    # Every batch is the arrivals of one 50 ms window of a fixed grid on the clock. The grid starts at the engine's
    # first arrival (the replay's warm-up request), so its phase against the trace is unknown: some phase must fit.
    def fits(phase: float) -> bool:
        return all(len({(a - phase) // 0.05 for a in group}) == 1 for group in groups)

    assert any(fits(a - 1e-6) for a in (r.arrival_s for r in trace.requests))


def test_dynamic_dispatches_full_batches_under_a_backlog_through_the_engine():
    trace = burst_trace(40, 0.002, 10)  # 40 requests within 80 ms: the queue fills faster than batches run
    run = sim_run("dynamic", trace, drain_s=2.0, args={"max_batch": 8, "max_wait_ms": 1000})
    assert compute_metrics(run).num_finished == 40
    assert [len(g) for g in _dispatch_groups(run)] == [8] * 5


def test_real_replay_on_the_tiny_model_writes_a_report(tiny_model_dir, tmp_path, capsys):
    from overlap.cli import main

    trace = Trace(tuple(TraceRequest(i * 0.1, 6, prompt_tokens=8) for i in range(12)), "tiny")
    path = tmp_path / "tiny.jsonl"
    trace.save_jsonl(path)
    out = tmp_path / "report"
    code = main(
        [
            "bench",
            "replay",
            "--trace",
            str(path),
            "--compare",
            "serial,continuous",
            "--num-threads",
            "1",
            "--drain-s",
            "20",
            "--json",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in summary["runs"]] == ["serial", "continuous"]
    for run in summary["runs"]:
        m = run["metrics"]
        assert m["num_finished"] == 12 and m["num_unfinished"] == 0
        assert m["tokens_per_s"] == pytest.approx(6 * m["requests_per_s"], rel=1e-3)
        assert 0 < m["device_busy_share"] <= 1
    assert "throughput_vs_serial" in summary["comparison"]
    assert (out / "report.md").is_file() and (out / "latency_cdf.png").is_file()


async def fake_openai_server(reject_every: int = 0, bodies: list | None = None):
    """Streams `max_tokens` chunks 10 ms apart; every `reject_every`-th request gets 429; records request bodies."""
    count = 0

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        nonlocal count
        count += 1
        body = await request.json()
        if bodies is not None:
            bodies.append(body)
        assert body["model"] == "fake-model" and body["stream"] is True
        if reject_every and count % reject_every == 0:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.01)
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def test_target_replay_streams_and_counts_rejections():
    runner, url = await fake_openai_server(reject_every=4)
    try:
        trace = burst_trace(8, 0.02, 5)
        run = await replay_endpoint.replay_target(trace, url, drain_s=5.0, progress=False)
    finally:
        await runner.cleanup()
    m = compute_metrics(run)
    assert (m.num_finished, m.num_rejected, m.num_unfinished) == (6, 2, 0)
    assert m.tokens_per_s == pytest.approx(6 * 5 / m.span_s)
    assert 8 <= m.itl_p50_ms < 60  # chunks 10 ms apart
    assert m.ttft_p50_ms >= 8
    assert m.queue_share is None and m.device_busy_share is None
    assert run.config["model"] == "fake-model"


async def test_target_replay_stops_at_the_drain_deadline():
    runner, url = await fake_openai_server()
    try:
        trace = burst_trace(3, 0.0, 200)  # 200 chunks x 10 ms = 2 s each
        run = await replay_endpoint.replay_target(trace, url, drain_s=0.3, progress=False)
    finally:
        await runner.cleanup()
    assert run.wall_s < 1.5
    assert compute_metrics(run).num_unfinished == 3


def test_command_line_transforms_and_quick_window():
    from overlap.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "replay",
            "--trace",
            "bursty",
            "--scale-rate",
            "0.5",
            "--scale-tokens",
            "0.5",
            "--burst",
            "2:1",
            "--quick",
            "--policy",
            "serial",
        ]
    )
    trace = workload.load_for_args(args)
    assert trace.duration_s <= workload.QUICK_TRACE_S
    described = trace.describe()
    for part in ("rate x0.5", "tokens x0.5", "2x burst at 2 s for 1 s", f"first {workload.QUICK_TRACE_S:g} s"):
        assert part in described
    with pytest.raises(TraceError, match="--burst"):
        workload.parse_burst("soon")
    with pytest.raises(TraceError, match="--sim-cost"):
        workload.parse_sim_cost("fast")


async def test_target_replay_sends_token_id_prompts_and_explicit_priorities_only():
    bodies: list = []
    runner, url = await fake_openai_server(bodies=bodies)
    try:
        trace = Trace((TraceRequest(0.0, 2, prompt_tokens=5), TraceRequest(0.01, 2, prompt="Hi", priority=0)), "p")
        await replay_endpoint.replay_target(trace, url, drain_s=5.0, progress=False)
    finally:
        await runner.cleanup()
    by_prompt = {json.dumps(b["prompt"]): b for b in bodies}
    assert "priority" not in by_prompt[json.dumps(workload.prompt_token_ids(trace.requests[0], 0, 0))]
    assert by_prompt['"Hi"']["priority"] == 0


def test_reproduce_command_keeps_global_options():
    argv = ["/x/bin/overlap", "--log-level", "DEBUG", "bench", "replay", "--trace", "my trace.jsonl", "--quick"]
    assert replay._reproduce_command(argv) == "overlap --log-level DEBUG bench replay --trace 'my trace.jsonl' --quick"
    assert replay._reproduce_command(["pytest", "-q"]) == ""


async def test_target_replay_reports_an_unreachable_target():
    from overlap.engine.errors import ConfigError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConfigError, match=re.escape(f"--target {url}: cannot read {url}/v1/models")):
        await replay_endpoint.replay_target(burst_trace(1, 0.0, 1), url, drain_s=1.0, progress=False)
