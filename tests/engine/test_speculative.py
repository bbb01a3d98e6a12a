"""Speculative decoding (docs/engine.md, "Speculative decoding"): vLLM's `--speculative-config` parsed and refused as
documented, the ngram proposer's lookup, the verification rule, and the scheduler's side on the fake runner (which
verifies proposals against a fake model that mostly quotes, reading every position back from its paged "pool": a
rejected proposal left where a later step reads it changes the tokens). Outputs equal the serial reference for 1, 2
and 3 buffers with stops, max_tokens, chunked prefill, prefix hits and preemption while proposals are in flight; the
KV blocks of rejected proposals go back."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from overlap.engine.batching.block_manager import BlockManager
from overlap.engine.batching.speculative import (
    COMPUTE_BOUND_ROWS,
    SPEC_MAX_BACKOFF,
    NgramProposer,
    num_to_propose,
    propose_ngram,
    record_acceptance,
)
from overlap.engine.config import EngineConfig, add_engine_flags, engine_argv, engine_overrides
from overlap.engine.errors import ConfigError
from overlap.engine.types import FinishReason, RequestSpec, RunnerOutput, SamplingParams, accept_proposals
from tests.support.engine import (
    copying_token,
    create_engine,
    create_requests,
    create_scheduler,
    reference_tokens,
    run_step,
    tokens_of,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ---- configuration ---------------------------------------------------------------------------------------------
def test_speculative_config_takes_vllms_json_and_defaults():
    assert EngineConfig().speculative is None
    assert EngineConfig(speculative_config={}).speculative is None
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 5, 5)  # vLLM's
    spec = EngineConfig(speculative_config={"model": "[ngram]", "num_speculative_tokens": 2,
                                            "prompt_lookup_max": 4}).speculative  # fmt: skip
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 4)
    config = EngineConfig(speculative_config=json.dumps(NGRAM))  # the flag's text works as well as the dict
    assert config.speculative_config == NGRAM and config.to_dict()["speculative_config"] == NGRAM
    assert config.replace(max_num_seqs=4).speculative == config.speculative
    draft = {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 3}
    spec = EngineConfig(speculative_config=draft).speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.prompt_lookup_max) == (*draft.values(), None)
    assert EngineConfig(speculative_config=draft).speculative_config == draft


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "eagle3", "num_speculative_tokens": 3, "model": "x"}, "EAGLE-3 heads are not implemented"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "EAGLE heads are not implemented"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "model": "x"}, "describes the checkpoint format"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "draft_model needs `model`"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "belong to"),
        ({"method": "mtp", "num_speculative_tokens": 1}, "multi-token-prediction"),
        ({"method": "bogus", "num_speculative_tokens": 1}, "method must be one of ngram"),
        ({"method": "ngram"}, "num_speculative_tokens must be an integer in 1..16"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unsupported keys"),
        ("{not json", "not valid JSON"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_speculative_config_refuses_what_it_does_not_run(raw, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(speculative_config=raw)


def test_speculative_config_flag_round_trips():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert engine_overrides(args) == {"speculative_config": NGRAM}
    assert parser.parse_args(engine_argv(args)).engine_speculative_config == NGRAM  # what `overlap serve` passes on
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1]"])


# ---- the ngram proposer ----------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 1, 3, 4) == [4, 1, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1]  # the latest occurrence
    assert propose_ngram([1, 2, 7, 2, 8, 1, 2], 1, 2, 2) == [7, 2]  # n = 2 ([1, 2]) wins over n = 1 ([2] -> 8)
    assert propose_ngram([1, 2, 7, 2, 8, 3, 2], 1, 2, 2) == [8, 3]  # no bigram match: the unigram's latest
    assert propose_ngram([1, 2, 7, 2, 8, 3, 2], 2, 2, 2) == []  # min_n 2: nothing
    assert propose_ngram([1, 2, 3], 1, 3, 2) == []
    assert propose_ngram([4, 4], 1, 1, 0) == []


def test_ngram_continues_a_period_past_the_end_and_never_matches_across_token_bytes():
    assert propose_ngram([5, 5, 5, 5], 1, 2, 4) == [5, 5, 5, 5]
    assert propose_ngram([7, 1, 2, 1, 2], 2, 2, 5) == [1, 2, 1, 2, 1]
    # [1, 0] is bytes 01 00 00 00 00 00 00 00; [256, 0, 256] holds them one byte in, straddling tokens: no match
    assert propose_ngram([256, 0, 256, 9, 1, 0], 2, 2, 2) == []
    assert propose_ngram([256, 0, 256, 9, 1, 0], 1, 1, 2) == [256, 9]  # [0] did occur, as token 1


def test_ngram_proposer_caps_k_by_the_config():
    spec = EngineConfig(speculative_config=NGRAM).speculative
    proposer = NgramProposer(spec)
    request, fresh = create_requests(2, prompt_len=3)
    request.all_token_ids[:] = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(request, 16) == [3, 4, 5, 6]
    assert proposer.propose(request, 2) == [3, 4]
    assert proposer.probe(request) and not proposer.probe(fresh)


def test_k_follows_recent_acceptance():
    (request,) = create_requests(1)
    assert num_to_propose(request.spec_accepted_avg, 4) == 4  # before any try: all of k
    for accepted, want in [(4, 4), (1, 3), (0, 2), (0, 1), (0, 1), (3, 2), (4, 3), (4, 4)]:
        record_acceptance(request, accepted)
        assert num_to_propose(request.spec_accepted_avg, 4) == want, (accepted, request.spec_accepted_avg)


def test_a_try_that_sat_a_step_out_gains_only_past_that_step():
    (request,) = create_requests(1)
    record_acceptance(request, 1)  # proposed with no step in flight: one accepted token is a gain
    assert request.spec_backoff == 0 and request.spec_skip == 0
    request.spec_waited = True  # sat a step out first: one accepted token only wins that step back
    record_acceptance(request, 1)
    assert request.spec_backoff == 1 and request.spec_skip == 1 and not request.spec_waited
    request.spec_waited = True
    record_acceptance(request, 2)
    assert request.spec_backoff == 0


# ---- the verification rule -------------------------------------------------------------------------------------
def test_accept_proposals_takes_the_agreeing_prefix_and_the_targets_next_token():
    assert accept_proposals([4, 5, 6], [4, 5]) == [4, 5, 6]  # all accepted, then the bonus token
    assert accept_proposals([4, 9, 6], [4, 5]) == [4, 9]  # the target's own token where it disagrees
    assert accept_proposals([7, 5, 6], [4, 5]) == [7]
    assert accept_proposals([3], []) == [3]


# ---- the scheduler and block manager, on the fake runner --------------------------------------------------------
def _workload(seed: int, n: int):
    """Half prompts that repeat a short unit (the fake model then quotes them), half random; mixed lengths, stops."""
    rng = random.Random(seed)
    requests = {}
    for i in range(n):
        if i % 2:
            unit = [rng.randrange(3, 64) for _ in range(rng.randint(2, 6))]
            prompt = unit * rng.randint(2, 5) + unit[: rng.randrange(len(unit))]
        else:
            prompt = [rng.randrange(3, 64) for _ in range(rng.randint(1, 30))]
        sampling = SamplingParams(
            max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=rng.random() < 0.5,
            stop_token_ids=(rng.randrange(3, 64),) if rng.random() < 0.3 else (),
        )  # fmt: skip
        requests[f"r{i}"] = (prompt, sampling)
    return requests


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
@pytest.mark.parametrize(
    "pool",
    [dict(num_blocks=512), dict(num_blocks=40, max_num_batched_tokens=16)],  # the second preempts and chunks
    ids=["roomy", "tight"],
)
def test_fake_model_outputs_equal_the_serial_reference_with_proposals(num_buffers, pool):
    # 40 requests at once: past the CPU's compute-bound rows, so the batch size that stops speculation is raised
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 256}  # fmt: skip
    engine = create_engine(model=copying_token, num_buffers=num_buffers, speculative_config=spec, **pool)
    requests = _workload(7, 40)
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(RequestSpec(rid, prompt, sampling))
    outputs: dict[str, list] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        bm = engine.block_manager
        bm.check_invariants(engine.scheduler.running)  # rollbacks keep claims and counts exact
        for r in engine.scheduler.running:  # nothing in flight: no block past its tokens (rejected ones went back)
            if not r.spec_in_flight and not r.num_placeholders:
                assert len(r.block_ids) <= bm.num_blocks_for(r.num_tokens), r.request_id
    for batch in engine.runner.batches:  # proposals plus the target's token never pass max_tokens
        for seq in batch.seqs:
            assert seq.num_generated + seq.num_draft_tokens + 1 <= seq.sampling.max_tokens or not seq.num_draft_tokens
    for rid, (prompt, sampling) in requests.items():
        got = tokens_of(outputs[rid])
        assert got == reference_tokens(prompt, sampling, model=copying_token), rid
        assert len(got) <= sampling.max_tokens
        assert [o.finished for o in outputs[rid]].count(True) == 1
    stats = engine.stats()
    drafts, accepted = stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]
    assert stats["spec_decode_num_drafts_total"] > 20 and accepted > 0.5 * drafts  # the fake model mostly quotes
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert stats["num_generation_tokens_total"] == sum(len(tokens_of(o)) for o in outputs.values())
    engine.close()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    if pool["num_blocks"] == 40:
        assert stats["num_preemptions_total"] > 0


def test_speculating_request_waits_for_its_verified_tokens_and_never_passes_max_tokens():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    scheduler, runner = create_scheduler(speculative_config=spec)
    runner.model = copying_token
    (r,) = create_requests(1, prompt_len=3, max_tokens=7)
    r.prompt_token_ids[:] = r.all_token_ids[:] = [5, 6, 7, 5, 6, 7, 5]
    scheduler.add_request(r, 0.0)
    run_step(scheduler, runner, 0.0)  # the prompt; its first token comes back
    batch = scheduler.schedule(0.1)
    (seq,) = batch.model_input.seqs
    assert seq.token_ids == [r.all_token_ids[-1], *propose_ngram(r.all_token_ids, 1, 2, 4)]
    assert seq.num_draft_tokens == 4 and seq.start_pos == r.num_tokens - 1 and r.spec_in_flight
    assert scheduler.schedule(0.2).is_empty  # not again while its proposals are being verified
    output = runner.execute(batch.model_input)
    scheduler.postprocess(batch, output, 0.3)
    assert not r.spec_in_flight and r.num_computed_tokens == r.num_tokens - 1
    for _ in range(20):
        if r.is_finished:
            break
        batch, _ = run_step(scheduler, runner, 0.4)
        for s in batch.model_input.seqs:  # proposals + the bonus token never pass max_tokens
            assert r.num_output_tokens <= r.sampling.max_tokens
            assert s.num_draft_tokens < r.sampling.max_tokens
    assert r.num_output_tokens == 7 and r.finish_reason is FinishReason.LENGTH
    assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling, model=copying_token)


def test_grammar_requests_never_speculate_and_misses_back_off():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    scheduler, runner = create_scheduler(speculative_config=spec)
    runner.model = copying_token
    quoting, with_grammar = create_requests(2, prompt_len=8, max_tokens=30, same_prompt=True)
    with_grammar.sampling.grammar = "any"  # the scheduler only reads whether there is one
    (distinct,) = create_requests(1, prompt_len=2, max_tokens=30)
    runner.model = lambda seq: (len(seq) * 7919) % 50 + 3 if len(set(seq)) == len(seq) else copying_token(seq)
    for r in (quoting, with_grammar, distinct):
        scheduler.add_request(r, 0.0)
    speculated = {r.request_id: 0 for r in (quoting, with_grammar, distinct)}
    for step in range(40):
        batch, _ = run_step(scheduler, runner, step * 0.01)
        for seq in batch.model_input.seqs:
            speculated[seq.request_id] += seq.num_draft_tokens > 0
    assert speculated[with_grammar.request_id] == 0
    assert speculated[quoting.request_id] > 0
    assert 0 < distinct.spec_backoff <= SPEC_MAX_BACKOFF  # every try gained nothing: it backs off


def test_trim_returns_the_blocks_of_rejected_proposals_and_keeps_the_claim():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    (r,) = create_requests(1, prompt_len=6, max_tokens=20)
    bm.allocate(r)
    assert r.block_ids == [0, 1] and r.claim_end == 7
    r.num_computed_tokens = 6
    assert bm.append_slots(r, 9)  # positions 6..14: the last token and 8 proposals
    assert r.block_ids == [0, 1, 2, 3]
    bm.check_invariants([r])
    for t in (3, 3, 3, 3):
        r.append_output_token(t)  # one proposal accepted and the bonus token ... and more
    r.num_computed_tokens = 9
    bm.trim(r, r.num_tokens)  # 10 tokens: blocks 0..2
    assert r.block_ids == [0, 1, 2] and bm.num_free_blocks == 13
    bm.check_invariants([r])
    assert bm.append_slots(r, 4) and r.block_ids == [0, 1, 2, 3]  # the run stays contiguous
    bm.free(r)
    bm.check_invariants([])


@pytest.mark.parametrize(("batch", "stop_at", "max_proposals"), [(4, None, 12), (12, None, 4), (16, None, 0),
                                                                 (20, None, 0), (20, 64, 44)])  # fmt: skip
def test_proposals_fill_a_step_only_up_to_the_compute_bound_rows(batch, stop_at, max_proposals):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    if stop_at is not None:
        spec["disable_by_batch_size"] = stop_at
    scheduler, _ = create_scheduler(speculative_config=spec, num_buffers=1)  # a scheduler alone counts as on a CPU
    assert scheduler.spec_max_rows == (stop_at or COMPUTE_BOUND_ROWS["cpu"]) == (stop_at or 16)
    for r in create_requests(batch, prompt_len=8, max_tokens=20, same_prompt=True):
        r.prompt_token_ids[:] = r.all_token_ids[:] = [5, 6, 7, 8] * 2
        scheduler.add_request(r, 0.0)
    prompts = scheduler.schedule(0.0)
    scheduler.postprocess(
        prompts, RunnerOutput([5] * batch, (0.0, 0.0)), 0.0
    )  # each first token repeats one: ngram proposes for every one
    batch_seqs = scheduler.schedule(0.1).model_input.seqs
    assert len(batch_seqs) == batch
    assert sum(seq.num_draft_tokens for seq in batch_seqs) == max_proposals


def test_with_a_token_in_flight_a_request_pauses_only_when_its_known_tokens_already_match():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 2}
    scheduler, _ = create_scheduler(speculative_config=spec)
    repeating, fresh = create_requests(2, prompt_len=8, max_tokens=20)
    repeating.prompt_token_ids[:] = repeating.all_token_ids[:] = [5, 6, 7, 8, 5, 6, 7, 8]
    fresh.prompt_token_ids[:] = fresh.all_token_ids[:] = [9, 10, 11, 12, 13, 14, 15, 16]
    for r in (repeating, fresh):
        scheduler.add_request(r, 0.0)
    first = scheduler.schedule(0.0)  # both prompts; their first tokens are in flight from here on
    assert [s.request_id for s in first.model_input.seqs] == [repeating.request_id, fresh.request_id]
    second = scheduler.schedule(0.1)  # scheduled before the first step's tokens are back
    # [7, 8] occurred before: the repeating request waits for its token to speculate; the fresh one decodes on
    assert [s.request_id for s in second.model_input.seqs] == [fresh.request_id]
    assert second.model_input.seqs[0].num_draft_tokens == 0 and fresh.spec_skip == 0
