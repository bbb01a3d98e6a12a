"""The engine through the N-buffered executor: the same tokens for 1, 2 and 3 buffers (and transformers' on the tiny
model), stops seen one step late without wrong output, preemption while steps are in flight, and a soak of 1,000
streamed requests with 20 random live reconfigurations that loses, duplicates and leaks nothing."""

from __future__ import annotations

import asyncio
import random

import pytest

from overlap.engine import Engine, EngineConfig, LiveKnobs, SamplingParams
from overlap.engine.model.sim_runner import CostModel, SimRunner
from overlap.engine.types import FinishReason, RequestSpec
from tests.support.engine import add_and_run, tokens_of

EOS = 2


def sim_engine(
    num_buffers: int, *, vocab_size=48, num_kv_blocks=512, block_size=4, step_s=0.0002, asynchronous=False, **config
):
    runner = SimRunner(
        CostModel(step_s, 2e-6),
        vocab_size=vocab_size,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_model_len=512,
        eos_token_ids=(EOS,),
        asynchronous=asynchronous,
    )
    config.setdefault("max_seq_len", 512)
    engine = Engine(EngineConfig(num_buffers=num_buffers, **config), runner=runner)  # the runner sets block_size
    return engine, runner


def expected(runner: SimRunner, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    out = []
    for token in runner.reference_tokens(prompt, max_tokens):
        out.append(token)
        if token == EOS and not ignore_eos:
            break
    return out


def assert_all_blocks_back(engine: Engine) -> None:
    engine.close()  # finishes the extra steps still in flight after the last EOS
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    bm.check_invariants([])
    assert engine.executor.num_in_flight == 0 and not engine._in_flight
    assert not engine.executor._last_token and not engine.executor._forget_later
    assert not getattr(engine.runner, "_device_last_token", None)


def workload(n: int, seed: int, vocab_size: int = 48, max_prompt: int = 40, max_tokens: int = 30):
    rng = random.Random(seed)
    return {
        f"r{i}": (
            [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, max_prompt))],
            SamplingParams(max_tokens=rng.randint(1, max_tokens), temperature=0, ignore_eos=rng.random() < 0.3),
        )
        for i in range(n)
    }


@pytest.mark.parametrize("asynchronous", [False, True], ids=["worker-thread", "async-device"])
@pytest.mark.parametrize("chunked", [True, False])
def test_sim_outputs_identical_for_1_2_3_buffers_with_eos_one_step_late(chunked, asynchronous):
    requests = workload(80, seed=5)
    results = {}
    for num_buffers in (1, 2, 3):
        engine, runner = sim_engine(
            num_buffers,
            max_num_seqs=16,
            max_num_batched_tokens=64 if chunked else 512,
            enable_chunked_prefill=chunked,
            asynchronous=asynchronous,
        )
        sampled = []
        name = "wait" if asynchronous else "execute"
        run = getattr(runner, name)
        setattr(runner, name, lambda batch, run=run, sampled=sampled: sampled.append(t := run(batch)) or t)
        outputs = add_and_run(engine, requests)
        assert set(outputs) == set(requests)
        for rid, (prompt, sampling) in requests.items():
            got = tokens_of(outputs[rid])
            assert got == expected(runner, prompt, sampling.max_tokens, sampling.ignore_eos), (num_buffers, rid)
            assert outputs[rid][-1].finished and sum(o.finished for o in outputs[rid]) == 1
            assert outputs[rid][-1].num_output_tokens == len(got)
        results[num_buffers] = {rid: tokens_of(o) for rid, o in outputs.items()}
        num_sampled = sum(len(t.token_ids) for t in sampled)
        num_delivered = sum(len(t) for t in results[num_buffers].values())
        if num_buffers == 1:
            assert num_sampled == num_delivered
        else:  # a step after EOS was already in flight: its token was sampled and dropped, never emitted
            assert num_sampled > num_delivered
        assert_all_blocks_back(engine)
    assert results[1] == results[2] == results[3]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["worker-thread", "async-device"])
@pytest.mark.parametrize("num_buffers", [2, 3])
def test_preemption_while_steps_are_in_flight_keeps_outputs_exact(num_buffers, asynchronous):
    requests = workload(40, seed=9, max_prompt=24, max_tokens=40)
    engine, runner = sim_engine(
        num_buffers, num_kv_blocks=48, max_num_seqs=24, max_num_batched_tokens=96, asynchronous=asynchronous
    )
    outputs = add_and_run(engine, requests)
    assert engine.stats()["num_preemptions_total"] > 0, "the pool was meant to force preemptions"
    for rid, (prompt, sampling) in requests.items():
        assert tokens_of(outputs[rid]) == expected(runner, prompt, sampling.max_tokens, sampling.ignore_eos), rid
    assert_all_blocks_back(engine)


def test_reconfigure_returns_what_was_applied_and_drains_in_order():
    engine, runner = sim_engine(3, num_kv_blocks=64, step_s=0.002)
    requests = workload(20, seed=2)
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(RequestSpec(rid, prompt, sampling))
    outputs: dict[str, list] = {}
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.executor.num_in_flight == 2  # three buffers: two steps still in flight after each step()
    knobs = LiveKnobs(num_buffers=1, max_num_seqs=10**6, max_num_batched_tokens=32, aging_s=1.0, default_timeout_s=None)
    applied = engine.reconfigure(knobs)
    assert applied == LiveKnobs(64, 32, 1, 1.0, None)  # max_num_seqs bounded by the KV pool
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        assert engine.executor.num_in_flight <= 2
    for rid, (prompt, sampling) in requests.items():
        assert tokens_of(outputs[rid]) == expected(runner, prompt, sampling.max_tokens, sampling.ignore_eos), rid
    stats = engine.stats()
    assert stats["num_buffers"] == 1 and stats["config"]["num_buffers"] == 1
    assert 0 < stats["device_busy_ratio"] <= 1
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["worker-thread", "async-device"])
async def test_soak_1000_streamed_requests_with_20_live_reconfigurations(asynchronous):
    rng = random.Random(1234)
    engine, runner = sim_engine(
        2, num_kv_blocks=160, max_num_seqs=32, max_num_batched_tokens=128, asynchronous=asynchronous
    )
    requests = workload(1000, seed=77, max_prompt=32, max_tokens=24)
    abort_early = set(rng.sample(sorted(requests), 20))  # clients that leave after their first token
    received: dict[str, list] = {}
    applied_configs = []

    async def client(rid: str) -> None:
        prompt, sampling = requests[rid]
        await asyncio.sleep(rng.random() * 1.5)  # arrivals spread over the run
        received[rid] = []
        async for out in engine.generate(RequestSpec(rid, prompt, sampling, priority=rng.randrange(3))):
            received[rid].append(out)
            if rid in abort_early and out.new_token_ids:
                break

    async def steps_pass_while_busy(n: int) -> bool:
        # Paced on the engine's own progress, not the wall clock, so a slow CI core cannot push changes into idle gaps.
        start = engine.stats()["num_steps_total"]
        while engine.stats()["num_steps_total"] - start < n or not engine.has_unfinished():
            if all(rid in received for rid in requests) and not engine.has_unfinished():
                return False  # the run is over
            await asyncio.sleep(0.002)
        return True

    async def operator() -> None:
        for _ in range(20):
            if not await steps_pass_while_busy(rng.randint(1, 6)):
                return
            knobs = {
                "num_buffers": rng.randint(1, 4),
                "max_num_seqs": rng.choice([4, 8, 16, 32, 64, 500]),
                "max_num_batched_tokens": rng.choice([16, 32, 64, 128, 512]),
                "aging_s": rng.choice([0.05, 0.5, 5.0]),
                "default_timeout_s": rng.choice([None, 600.0]),
            }
            busy_now = engine.has_unfinished()
            applied_configs.append((knobs, engine.reconfigure(LiveKnobs(**knobs)), busy_now))

    await asyncio.wait_for(asyncio.gather(operator(), *(client(rid) for rid in requests)), timeout=240)
    for _ in range(200):  # the aborts' final outputs come from the next steps
        if not engine.has_unfinished():
            break
        await asyncio.sleep(0.01)
    assert not engine.has_unfinished()

    assert len(applied_configs) == 20, "the run ended before the operator made its 20 changes"
    assert all(busy for _, _, busy in applied_configs), "every change must land while requests are running"
    assert engine.stats()["num_steps_total"] > 200
    for knobs, applied, _ in applied_configs:
        assert applied.num_buffers == knobs["num_buffers"]
        assert applied.max_num_seqs == min(knobs["max_num_seqs"], engine.block_manager.num_blocks)
    assert set(received) == set(requests)  # none lost
    for rid, (prompt, sampling) in requests.items():
        outs = received[rid]
        got = tokens_of(outs)
        want = expected(runner, prompt, sampling.max_tokens, sampling.ignore_eos)
        if rid in abort_early:
            assert got and got == want[: len(got)], rid  # a prefix, nothing duplicated
        else:
            assert got == want, rid  # none duplicated, none wrong
            assert outs[-1].finished and outs[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert [o.finished for o in outs].count(True) == 1
    finished = engine.stats()["requests_finished_total"]
    assert sum(finished.values()) == 1000 and finished["abort"] <= len(abort_early)
    assert_all_blocks_back(engine)


# ---- the real tiny model ------------------------------------------------------------------------------------------
def test_tiny_model_greedy_is_identical_for_1_2_3_buffers_and_equals_transformers(
    tiny_model_dir, hf_greedy, two_torch_threads
):
    rng = random.Random(3)
    requests = {
        f"t{i}": ([rng.randrange(3, 8192) for _ in range(rng.randint(4, 40))], rng.randint(8, 20)) for i in range(10)
    }
    results = {}
    for num_buffers in (1, 2, 3):
        engine = Engine(
            EngineConfig(
                model=str(tiny_model_dir),
                num_buffers=num_buffers,
                max_seq_len=128,
                num_kv_blocks=128,
                max_num_batched_tokens=48,  # chunked prefills mixed with decodes
            )
        )
        sampling = {rid: SamplingParams(max_tokens=n, temperature=0) for rid, (_, n) in requests.items()}
        outputs = add_and_run(engine, {rid: (prompt, sampling[rid]) for rid, (prompt, _) in requests.items()})
        results[num_buffers] = {rid: tokens_of(outs) for rid, outs in outputs.items()}
        assert_all_blocks_back(engine)
    assert results[1] == results[2] == results[3]
    for rid, (prompt, max_tokens) in requests.items():
        assert results[2][rid] == hf_greedy(prompt, max_tokens), rid
