"""The public Engine on the fake runner: validation, abort, failures, stats, reconfigure, generate()."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from overlap.engine import (
    ConfigError,
    Engine,
    EngineConfig,
    InvalidRequestError,
    LiveKnobs,
    ModelLoadError,
    SamplingParams,
)
from overlap.engine.types import FinishReason, RequestSpec
from tests.support.engine import VOCAB, create_engine, reference_tokens, run_to_completion, tokens_of

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def engine() -> Engine:
    return create_engine(num_blocks=64, block_size=4, max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_token_ids": []}, "empty prompt"),
        ({"prompt_token_ids": [5] * 64}, "prompt has 64 tokens; max_seq_len is 64"),
        ({"prompt_token_ids": [5] * 60, "sampling": SamplingParams(max_tokens=5)}, r"\+ max_tokens \(5\) exceeds"),
        ({"prompt_token_ids": [5, VOCAB]}, f"token id {VOCAB} is outside the vocabulary"),
        ({"prompt_token_ids": [5, -1]}, "token id -1 is outside the vocabulary"),
        ({"prompt_token_ids": [5, 2.5]}, "token ids must be integers"),
        ({"priority": 3}, r"priority must be an integer in 0\.\.2"),
        ({"priority": -1}, "priority must be"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"timeout_s": -2.0}, "timeout_s must be > 0"),
        ({"sampling": {"max_tokens": 3}}, "sampling must be SamplingParams"),
        ({"request_id": ""}, "request_id must be a non-empty string"),
    ],
)
def test_bad_input_is_refused_with_a_specific_error(engine: Engine, kwargs: dict, match: str) -> None:
    call = {"request_id": "r", "prompt_token_ids": [5, 6], "sampling": GREEDY} | kwargs
    request_id, prompt, sampling = call.pop("request_id"), call.pop("prompt_token_ids"), call.pop("sampling")
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(RequestSpec(request_id, prompt, sampling, **call))
    assert not engine.has_unfinished()


def test_bad_sampling_values_are_refused_by_sampling_params() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


def test_duplicate_ids_are_refused_while_live_and_accepted_after_finishing(engine: Engine) -> None:
    engine.add_request(RequestSpec("dup", [5, 6], GREEDY))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(RequestSpec("dup", [7], GREEDY))
    run_to_completion(engine)
    engine.add_request(RequestSpec("dup", [7], GREEDY))  # finished ids may be reused


def test_a_request_bigger_than_the_whole_kv_pool_is_refused() -> None:
    engine = create_engine(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="needs 5 KV blocks but the pool holds 4"):
        engine.add_request(RequestSpec("big", [5] * 12, SamplingParams(max_tokens=8)))


def test_outputs_match_the_reference_and_carry_times(engine: Engine) -> None:
    prompts = {f"r{i}": [(3 * i + j) % 50 + 2 for j in range(3 + i)] for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(RequestSpec(rid, prompt, GREEDY))
    outputs = run_to_completion(engine)
    for rid, prompt in prompts.items():
        assert tokens_of(outputs[rid]) == reference_tokens(prompt, GREEDY)
        final = outputs[rid][-1]
        assert final.finished and final.finish_reason is FinishReason.LENGTH
        assert [o.finished for o in outputs[rid]].count(True) == 1
        t = final.times
        assert t.arrived <= t.queued <= t.first_scheduled <= t.first_token <= t.finished
        assert final.num_prompt_tokens == len(prompt) and final.num_output_tokens == 8


def test_eos_stops_a_request_unless_ignored() -> None:
    engine = create_engine()
    # Find a prompt whose reference continuation hits EOS (token 1) early.
    prompt = next(
        [p, q]
        for p in range(2, VOCAB)
        for q in range(2, VOCAB)
        if 1 in reference_tokens([p, q], SamplingParams(max_tokens=4, ignore_eos=True))
    )
    engine.add_request(RequestSpec("stop", prompt, SamplingParams(max_tokens=4, temperature=0)))
    engine.add_request(RequestSpec("go", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    outputs = run_to_completion(engine)
    assert outputs["stop"][-1].finish_reason is FinishReason.STOP and tokens_of(outputs["stop"])[-1] == 1
    assert outputs["go"][-1].finish_reason is FinishReason.LENGTH and len(tokens_of(outputs["go"])) == 4


def test_abort_emits_an_abort_output_at_the_next_step_and_frees_blocks(engine: Engine) -> None:
    engine.add_request(RequestSpec("a", [5] * 10, SamplingParams(max_tokens=30, ignore_eos=True)))
    engine.add_request(RequestSpec("b", [6] * 10, SamplingParams(max_tokens=30, ignore_eos=True)))
    engine.step()
    assert engine.abort("a")
    assert not engine.abort("unknown")
    outputs = engine.step()
    finals = [o for o in outputs if o.request_id == "a"]
    assert len(finals) == 1 and finals[0].finished and finals[0].finish_reason is FinishReason.ABORT
    assert not engine.abort("a")  # already finished
    run_to_completion(engine)
    assert engine.stats()["num_free_kv_blocks"] == 64
    assert engine.stats()["requests_finished_total"]["abort"] == 1


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine: Engine) -> None:
    engine.runner.fail_on.add("bad")
    engine.add_request(RequestSpec("bad", [5, 6, 7], GREEDY))
    engine.add_request(RequestSpec("good", [8, 9], GREEDY))
    outputs = engine.step()  # both run in the failing step
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finish_reason is FinishReason.ERROR and "injected failure" in by_id["bad"].error
    assert by_id["good"].finish_reason is FinishReason.ERROR  # it shared the failed forward
    engine.add_request(RequestSpec("after", [8, 9], GREEDY))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["after"]) == reference_tokens([8, 9], GREEDY)
    stats = engine.stats()
    assert stats["requests_finished_total"]["error"] == 2 and stats["num_free_kv_blocks"] == 64


def test_step_with_nothing_to_do_returns_quickly(engine: Engine) -> None:
    start = time.perf_counter()
    for _ in range(100):
        assert engine.step() == []
    assert time.perf_counter() - start < 1.0


STATS_KEYS = {
    "num_waiting", "num_running", "num_preempted", "num_waiting_by_priority", "num_running_by_priority",
    "kv_usage", "num_kv_blocks", "num_free_kv_blocks", "prefix_cache_hit_rate", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "num_preemptions_total", "num_prompt_tokens_total", "num_generation_tokens_total",
    "num_steps_total", "last_step_time_s", "avg_step_time_s", "last_batch_size", "avg_batch_size",
    "schedule_time_s_avg", "device_busy_ratio", "device_kernel_busy_ratio", "requests_finished_total", "config",
    # overlapped execution (overlap.engine.execution.base, overlap.engine.execution.busy)
    "device_busy_window_s", "device_idle_gap_ms", "host_ms_per_step", "num_buffers", "num_steps_in_flight",
    # speculative decoding (docs/engine.md, "Speculative decoding"), as vLLM's spec_decode counters
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos",
    # the sliding layers' own pool of a model that mixes layer types (batching/window_blocks.py; 0 without one)
    "num_window_kv_blocks", "num_free_window_kv_blocks",
    # LoRA adapters of running and waiting requests (vllm:lora_requests_info, docs/lora.md)
    "lora_running", "lora_waiting",
}  # fmt: skip


def test_stats_have_every_key_and_serialise_to_json(engine: Engine) -> None:
    engine.add_request(RequestSpec("a", [5] * 6, GREEDY, priority=0))
    engine.add_request(RequestSpec("b", [6] * 6, GREEDY, priority=2))
    stats = engine.stats()
    assert set(stats) == STATS_KEYS
    assert stats["num_waiting"] == 2
    engine.step()
    stats = engine.stats()
    assert stats["num_running_by_priority"] == [1, 0, 1] and stats["num_waiting_by_priority"] == [0, 0, 0]
    assert 0 < stats["kv_usage"] <= 1 and stats["last_batch_size"] == 2 and stats["num_steps_total"] == 1
    run_to_completion(engine)
    stats = json.loads(json.dumps(engine.stats()))
    assert stats["num_prompt_tokens_total"] == 12 and stats["num_generation_tokens_total"] == 16
    assert stats["requests_finished_total"]["length"] == 2 and 0 <= stats["device_busy_ratio"] <= 1


def test_reconfigure_applies_live_knobs_and_refuses_others(engine: Engine) -> None:
    applied = engine.reconfigure(engine.config.live.replace(max_num_seqs=2, aging_s=1.5, max_num_batched_tokens=100))
    assert applied == LiveKnobs(2, 100, engine.config.num_buffers, 1.5, None)
    assert LiveKnobs.of(engine.stats()["config"]) == applied
    assert engine.scheduler.waiting.aging_s == 1.5
    for i in range(5):
        engine.add_request(RequestSpec(f"r{i}", [5, 6], GREEDY))
    engine.step()
    assert engine.stats()["num_running"] == 2
    with pytest.raises(ConfigError, match="not live knobs: block_size"):
        engine.config.live.replace(block_size=32)
    with pytest.raises(ConfigError, match="max_num_seqs must be >= 1"):
        engine.config.live.replace(max_num_seqs=0)
    with pytest.raises(ConfigError, match="max_num_seqs must be an integer"):
        engine.config.live.replace(max_num_seqs="8")
    assert engine.reconfigure(engine.config.live.replace(max_num_seqs=10_000)).max_num_seqs == 64  # the KV pool's
    # knobs that the rest of the config refuses: nothing changes
    unchunked = create_engine(enable_chunked_prefill=False, max_seq_len=64, max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="without chunked prefill"):
        unchunked.reconfigure(unchunked.config.live.replace(max_num_batched_tokens=32))
    assert unchunked.config.max_num_batched_tokens == 64


def test_timeout_while_queued_finishes_with_timeout() -> None:
    engine = create_engine(batching="serial")
    engine.add_request(RequestSpec("busy", [5] * 4, SamplingParams(max_tokens=40, ignore_eos=True)))
    engine.add_request(RequestSpec("late", [6] * 4, GREEDY, timeout_s=0.05))
    engine.step()
    time.sleep(0.06)
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["late"].finish_reason is FinishReason.TIMEOUT and outputs["late"].new_token_ids == []
    assert outputs["late"].times.first_scheduled is None


def test_default_timeout_applies_when_none_is_given() -> None:
    engine = create_engine(batching="serial", default_timeout_s=0.01)
    engine.add_request(RequestSpec("busy", [5] * 4, SamplingParams(max_tokens=40, ignore_eos=True), timeout_s=60))
    engine.add_request(RequestSpec("late", [6] * 4, GREEDY))
    engine.step()
    time.sleep(0.02)
    outputs = run_to_completion(engine)
    assert outputs["late"][-1].finish_reason is FinishReason.TIMEOUT
    assert outputs["busy"][-1].finish_reason is FinishReason.LENGTH


async def test_generate_streams_several_requests_concurrently(engine: Engine) -> None:
    prompts = {f"g{i}": [i + 2, i + 3, i + 4] for i in range(5)}

    async def collect(i: int, rid: str) -> list:
        return [out async for out in engine.generate(RequestSpec(rid, prompts[rid], GREEDY, priority=i % 3))]

    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(collect(i, rid) for i, rid in enumerate(prompts))), timeout=20
        )
    finally:
        engine.close()
    for rid, outs in zip(prompts, results, strict=True):
        assert tokens_of(outs) == reference_tokens(prompts[rid], GREEDY)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])


async def test_leaving_generate_early_aborts_the_request(engine: Engine) -> None:
    engine.runner.delay_s = 0.005  # 40 tokens take ~0.2 s: the abort lands long before the end
    try:
        async with contextlib.aclosing(
            engine.generate(RequestSpec("early", [5, 6], SamplingParams(max_tokens=40, ignore_eos=True)))
        ) as stream:
            async for _ in stream:
                break
        for _ in range(200):
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished()
        assert engine.stats()["requests_finished_total"]["abort"] == 1
        assert engine.stats()["num_free_kv_blocks"] == 64
    finally:
        engine.close()


async def test_generate_refuses_bad_input_with_the_same_error(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        async for _ in engine.generate(RequestSpec("x", [], GREEDY)):
            pass


def test_engine_config_model_folder_that_does_not_exist_fails_clearly(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "nope")))
