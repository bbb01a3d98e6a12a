"""Speculative decoding on the real model runner (docs/engine.md, "Speculative decoding").

Greedy with ngram proposals gives exactly the tokens of no speculation for 16 prompts x 64 tokens, half repeating a
short unit and half random, on the tiny model (random weights: its output seldom repeats, so proposals are few and
mostly rejected) and on `tiny-copy` (the tiny model's shape with an induction circuit: it quotes, so nearly every
proposal on a repeating prompt is accepted and a step appends several tokens). The same with chunked prefill mixing
prompt chunks into verifying steps, with prefix-cache hits, with 1 and 2 buffers, and on two tensor-parallel ranks.
Sampling: the verification function's output follows the target distribution (temperature, top-k, top-p applied)
by a chi-squared test per position, and through the engine the joint distribution of sampled tokens with
speculation matches the one without it; a seeded request samples the same tokens either way. Penalties, logit bias,
logprobs, stop ids and max_tokens stay exact.
"""

from __future__ import annotations

import collections
import itertools
import random

import pytest
import torch

from overlap.engine import Engine, EngineConfig, SamplingParams
from overlap.engine.model import sampler
from overlap.engine.types import FinishReason
from tests.support.engine import add_and_run, tokens_of

# batches of 16 and more: past the CPU's compute-bound rows, so the batch size that stops speculation is raised
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 1024,
}
P_MIN = 1e-3  # the chi-squared tests' threshold: a p-value below it fails (fixed seeds: the outcome is fixed too)
VOCAB = 8192


@pytest.fixture(scope="module")
def copy_model_dir():
    from overlap.bench.copy_model import ensure_copy_model

    return ensure_copy_model()


def _prompts(seed: int, num_repeating: int = 8, num_random: int = 8) -> dict[str, list[int]]:
    rng = random.Random(seed)
    prompts = {}
    for i in range(num_repeating):
        unit = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]
        prompts[f"rep{i}"] = unit * rng.randint(2, 4) + unit[: rng.randrange(len(unit))]
    for i in range(num_random):
        prompts[f"rnd{i}"] = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))]
    return prompts


def _run(model_dir, requests: dict, **config) -> tuple[dict, dict, dict]:
    """(tokens by request, outputs by request, stats) of one engine over `requests` (id -> (prompt, sampling))."""
    config.setdefault("max_seq_len", 256)
    config.setdefault("num_kv_blocks", 256)
    engine = Engine(EngineConfig(model=str(model_dir), **config))
    try:
        outputs = add_and_run(engine, requests)
        stats = engine.stats()
    finally:
        engine.close()
        engine.runner.close()  # its tensor-parallel ranks and process group too, for the tests after this one
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    bm.check_invariants([])
    return {rid: tokens_of(outs) for rid, outs in outputs.items()}, outputs, stats


def _greedy(prompts: dict, max_tokens: int = 64) -> dict:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return {rid: (prompt, sampling) for rid, prompt in prompts.items()}


def _acceptance(stats: dict) -> float:
    return stats["spec_decode_num_accepted_tokens_total"] / max(1, stats["spec_decode_num_draft_tokens_total"])


# ---- greedy: exactly the tokens of no speculation ---------------------------------------------------------------
@pytest.mark.parametrize("model", ["tiny", "tiny-copy"])
def test_greedy_with_ngram_equals_no_speculation_16_prompts_x_64_tokens(model, tiny_model_dir, copy_model_dir):
    model_dir = tiny_model_dir if model == "tiny" else copy_model_dir
    requests = _greedy(_prompts(1))
    plain, _, _ = _run(model_dir, requests)
    spec, outputs, stats = _run(model_dir, requests, speculative_config=NGRAM)
    assert spec == plain
    assert stats["spec_decode_num_drafts_total"] > 0  # proposals were verified (some accepted, some not)
    if model == "tiny-copy":
        # it quotes: on a repeating prompt nearly every proposal is accepted, and a step appends several tokens
        assert _acceptance(stats) > 0.9
        for rid in requests:
            if rid.startswith("rep"):
                steps = sum(1 for out in outputs[rid] if out.new_token_ids)
                assert 64 / steps > 3, (rid, steps)
        per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
        assert len(per_pos) == 4 and per_pos[0] >= per_pos[3] > 0


@pytest.mark.parametrize(("model", "num_buffers"), [("tiny-copy", 2), ("tiny", 1)])
def test_greedy_equal_with_chunked_prefill_and_prefix_cache_hits(model, num_buffers, copy_model_dir, tiny_model_dir):
    # a 24-token budget: prompts arrive in chunks beside steps that verify proposals; the second wave repeats the
    # first one's prompts (prefix-cache hits on blocks the first wave published while speculating) behind a
    # shared one, and the tiny model's mostly rejected proposals go through the same steps
    prompts = _prompts(2, num_repeating=6, num_random=2)
    wave2 = {f"again-{rid}": [*p, 7, 8] for rid, p in prompts.items()}
    for model_dir in [copy_model_dir if model == "tiny-copy" else tiny_model_dir]:
        results = {}
        for spec in (None, NGRAM):
            config = dict(model=str(model_dir), max_seq_len=256, num_kv_blocks=128, max_num_batched_tokens=24,
                          num_buffers=num_buffers, speculative_config=spec)  # fmt: skip
            engine = Engine(EngineConfig(**config))
            first = add_and_run(engine, _greedy(prompts, 40))
            second = add_and_run(engine, _greedy(wave2, 40))
            stats = engine.stats()
            engine.close()
            engine.block_manager.check_invariants([])
            results[spec is None] = {rid: tokens_of(outs) for rid, outs in {**first, **second}.items()}
            assert stats["prefix_cache_hits_total"] > 0
            if spec is not None and model_dir == copy_model_dir:
                assert _acceptance(stats) > 0.8
        assert results[True] == results[False], model_dir


def test_two_tensor_parallel_ranks_with_ngram_equal_one_rank_without(copy_model_dir):
    requests = _greedy(_prompts(3, num_repeating=3, num_random=1), 32)
    plain, _, _ = _run(copy_model_dir, requests, num_threads=1)
    spec, _, stats = _run(copy_model_dir, requests, num_threads=1, tensor_parallel_size=2, speculative_config=NGRAM)
    assert spec == plain and _acceptance(stats) > 0.8


def test_greedy_equal_on_the_paths_cuda_takes_with_decode_graphs(copy_model_dir):
    """The device-generic paths (the Triton kernel, run by Triton's interpreter here, graphs' host side for the plain
    decode steps, acceptance on the device): the same tokens as the CPU paths without speculation."""
    pytest.importorskip("triton")
    from overlap.engine.model.runner import ModelRunner
    from tests.engine.test_decode_graphs import eager_capture

    requests = _greedy(_prompts(6, num_repeating=1, num_random=1), 12)
    plain, _, _ = _run(copy_model_dir, requests)
    config = EngineConfig(model=str(copy_model_dir), max_seq_len=256, num_kv_blocks=64, attention_backend="triton",
                          speculative_config=NGRAM)  # fmt: skip
    runner = ModelRunner(config, copy_model_dir, cpu_paths=False)
    runner.enable_decode_graphs(eager_capture, limit=4)
    engine = Engine(config, runner=runner)
    outputs = add_and_run(engine, requests)
    stats = engine.stats()
    engine.close()
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == plain
    assert _acceptance(stats) > 0.8 and runner.graph_steps > 0


# ---- the rest of a request's parameters stay exact --------------------------------------------------------------
def test_penalties_bias_logprobs_stops_and_max_tokens_are_the_same_with_speculation(copy_model_dir):
    prompts = _prompts(4, num_repeating=6, num_random=2)
    rng = random.Random(4)
    requests = {}
    for i, (rid, prompt) in enumerate(prompts.items()):
        kind = i % 4
        params = dict(max_tokens=rng.randint(5, 40), temperature=0, ignore_eos=True, logprobs=2)
        if kind == 0:  # penalties count earlier proposals as generated: a short unit repeats inside the proposals
            prompt = prompt[:3] * 4
            params.update(repetition_penalty=1.2, frequency_penalty=1.5, presence_penalty=1.0, max_tokens=40)
        elif kind == 1:  # a stop id in the middle of what would be accepted
            params.update(stop_token_ids=(prompt[len(prompt) // 2],), min_tokens=2)
        elif kind == 2:  # bias and a banned token
            params.update(logit_bias=((prompt[1], 5.0), (prompt[2], -100.0)), bad_words_ids=((prompt[3],),))
        requests[rid] = (prompt, SamplingParams(**params))
    plain, plain_outs, _ = _run(copy_model_dir, requests)
    spec, spec_outs, stats = _run(copy_model_dir, requests, speculative_config=NGRAM)
    assert spec == plain and stats["spec_decode_num_accepted_tokens_total"] > 0
    for rid, (_, sampling) in requests.items():
        assert len(spec[rid]) <= sampling.max_tokens
        assert spec_outs[rid][-1].finish_reason == plain_outs[rid][-1].finish_reason
        if sampling.stop_token_ids and sampling.stop_token_ids[0] in spec[rid]:
            assert spec[rid].index(sampling.stop_token_ids[0]) == len(spec[rid]) - 1
            assert spec_outs[rid][-1].finish_reason is FinishReason.STOP
        got = [lp for out in spec_outs[rid] for lp in out.logprobs]
        want = [lp for out in plain_outs[rid] for lp in out.logprobs]
        assert len(got) == len(want) == len(spec[rid])
        for a, b in zip(got, want, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_sampling_draws_the_same_tokens_with_speculation(copy_model_dir, tiny_model_dir):
    # A seeded request draws position n's uniform number from (seed, n): the row that scores a proposal at n uses
    # the number the plain step at n would, so the tokens are the same, accepted or not.
    prompts = _prompts(5, num_repeating=4, num_random=2)
    requests = {rid: (p, SamplingParams(max_tokens=32, temperature=3.0, top_p=0.95, top_k=40, seed=i, ignore_eos=True))
                for i, (rid, p) in enumerate(prompts.items())}  # fmt: skip
    for model_dir in (copy_model_dir, tiny_model_dir):
        plain, _, _ = _run(model_dir, requests)
        spec, _, stats = _run(model_dir, requests, speculative_config=NGRAM)
        assert spec == plain
        if model_dir == copy_model_dir:  # (the tiny model's sampled output never repeats: nothing to propose)
            assert stats["spec_decode_num_drafts_total"] > 10 and 0.1 < _acceptance(stats) < 0.95, _acceptance(stats)


# ---- sampling: the target's distribution --------------------------------------------------------------------------
def _chi2_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's chi-squared test of counts against expected counts (cells with mass only)."""
    cells = [(o, e) for o, e in zip(observed, expected, strict=True) if e > 0]
    assert all(o == 0 for o, e in zip(observed, expected, strict=True) if e == 0), "a token outside the support"
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the engine must sample from: softmax(logits / T), cut to the top-k, then to the smallest
    most-likely set of mass >= top-p, renormalised (written out here independently of the sampler)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if params.top_k:
        keep[order[: params.top_k]] = True
    else:
        keep[:] = True
    kept = probs * keep
    kept /= kept.sum()
    mass = 0.0
    nucleus = torch.zeros_like(keep)
    for token in order.tolist():
        if not keep[token] or mass >= params.top_p:
            continue
        nucleus[token] = True
        mass += float(kept[token])
    out = kept * nucleus
    return out / out.sum()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=5),
     SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["temperature", "top-k", "top-p", "top-k-top-p"],
)  # fmt: skip
def test_verification_samples_each_position_from_the_target_distribution(params):
    """20,000 verifications of 2 proposals on an 8-token vocabulary: the first token appended follows the target at
    position 0 (accepting proposal 1 with probability p0(d1), else a draw from p0 without it); after an accepted
    proposal the next follows position 1's target, after two position 2's."""
    gen = torch.Generator().manual_seed(0)
    vocab, trials = 8, 20_000
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    targets = [_target(logits[j], params) for j in range(3)]
    drafts = [int(targets[0].argmax()), int(targets[1].argsort(descending=True)[1])]  # a likely and a less likely one
    rows = logits.repeat(trials, 1)
    spec = [(t, 3 * t, drafts) for t in range(trials)]
    tokens, finite = sampler.sample(rows, [params] * (3 * trials), [0, 1, 2] * trials, torch.Generator().manual_seed(1))
    _, _, (accepted, table) = sampler.verify_proposals(tokens, finite, [3 * t for t in range(trials)], spec)
    appended = [row[: n + 1] for n, row in zip(accepted.tolist(), table.tolist(), strict=True)]
    for position in range(3):
        reached = [a[position] for a in appended if len(a) > position]
        counts = [reached.count(v) for v in range(vocab)]
        expected = [float(targets[position][v]) * len(reached) for v in range(vocab)]
        assert len(reached) > 1000, position
        assert _chi2_p(counts, expected) > P_MIN, (position, counts, [round(e) for e in expected])
    # and acceptance happens at the rate the target gives the proposals
    assert sum(len(a) > 1 for a in appended) / trials == pytest.approx(float(targets[0][drafts[0]]), abs=0.015)


def test_engine_samples_the_same_joint_distribution_with_speculation(tmp_path):
    """A 256-token Llama, prompts alternating two tokens that a logit bias puts far above the rest and top_k 2 keeps
    alone (their odds still follow the model), unseeded: the 5 tokens of 2,000 requests, with and without
    speculation, are one distribution by a two-sample chi-squared test over the 32 outcomes, while about half of the
    speculating run's proposals are accepted; with ngram, and with the model drafting for itself (greedy proposals:
    the likelier token, accepted at its probability)."""
    from tests.support.hf_models import save_variant

    folder = save_variant("llama", tmp_path / "llama")
    sampling = SamplingParams(max_tokens=5, temperature=1.0, top_k=2, logit_bias=((5, 60.0), (6, 60.0)))
    requests = {f"s{i}": ([5, 6] * 6 + [5] * (i % 2), sampling) for i in range(2000)}
    cells = list(itertools.product((5, 6), repeat=5))
    draft = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 4, "disable_by_batch_size": 1024}
    counts = {}
    for name, spec in (("plain", None), ("ngram", NGRAM), ("draft", draft)):
        engine = Engine(EngineConfig(model=str(folder), max_seq_len=64, num_kv_blocks=1024, max_num_seqs=256,
                                     speculative_config=spec, seed=11))  # fmt: skip
        outputs = add_and_run(engine, requests)
        engine.close()
        if spec is not None:
            stats = engine.stats()
            assert stats["spec_decode_num_draft_tokens_total"] > 2000
            assert 0.2 < _acceptance(stats) < 0.9, (name, _acceptance(stats))
        joint = collections.Counter(tuple(tokens_of(outputs[rid])) for rid in requests)
        assert set(joint) <= set(cells)
        counts[name] = [joint[cell] for cell in cells]
    for name in ("ngram", "draft"):
        stat, df = 0.0, -1
        for a, b in zip(counts["plain"], counts[name], strict=True):  # 2 x 32 table, equal sizes: pooled expectations
            pooled = (a + b) / 2
            if pooled:
                stat += (a - pooled) ** 2 / pooled + (b - pooled) ** 2 / pooled
                df += 1
        p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
        assert p > P_MIN, (name, counts["plain"], counts[name])
