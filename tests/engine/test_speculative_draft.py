"""Speculative decoding with a draft model (`draft_model`; docs/engine.md, "Speculative decoding").

Greedy output is exactly the tokens of no speculation, half the prompts repeating a short unit, half random: for 16
prompts x 64 tokens with a smaller random model of the tiny tokenizer drafting for the tiny model (nearly every
proposal is rejected, and rolled back in both pools), and for 8 x 32 with tiny-copy drafting for itself (every
proposal must be accepted); the same under chunked prefill with prefix-cache hits at 2 buffers, and on two
tensor-parallel ranks. Seeded sampling draws the same tokens. A draft whose vocabulary differs from the target's is
refused at start-up. (Sampling's distribution is the verification's, tested by chi-squared in
test_speculative_model.py: a greedy draft's proposals are a deterministic function of the tokens, as ngram's are.)
"""

from __future__ import annotations

import json

import pytest

from overlap.engine import Engine, EngineConfig, SamplingParams
from overlap.engine.errors import ConfigError
from tests.engine.test_speculative_model import _acceptance, _greedy, _prompts, _run
from tests.support.engine import add_and_run, tokens_of


def _draft(model_dir, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k,
            "disable_by_batch_size": 1024}  # fmt: skip


def _write_small_model(folder, **shape) -> str:
    """A random Llama smaller than the tiny model, with the tiny tokenizer (or another vocabulary size)."""
    import torch
    from transformers import LlamaForCausalLM

    from overlap.engine.model.builder import load_tokenizer, tiny_config

    torch.manual_seed(7)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2) | shape  # fmt: skip
    LlamaForCausalLM(tiny_config(**shape)).save_pretrained(folder, safe_serialization=True)
    load_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def copy_model_dir():
    from overlap.bench.copy_model import ensure_copy_model

    return ensure_copy_model()


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory):
    return _write_small_model(tmp_path_factory.mktemp("draft") / "small")


# (the copying model drafting for itself runs 4 forwards of the tiny shape per step and sequence: fewer prompts)
@pytest.mark.parametrize("pair", ["small random draft for tiny, 16 x 64", "copy drafts for itself, 8 x 32"])
def test_greedy_with_a_draft_model_equals_no_speculation(pair, copy_model_dir, tiny_model_dir, small_draft_dir):
    target, draft = (copy_model_dir, copy_model_dir) if pair.startswith("copy") else (tiny_model_dir, small_draft_dir)
    num_prompts, num_tokens = (4, 32) if target == draft else (8, 64)
    requests = _greedy(_prompts(1, num_prompts, num_prompts), num_tokens)
    plain, _, _ = _run(target, requests)
    config = dict(model=str(target), max_seq_len=256, num_kv_blocks=256, speculative_config=_draft(draft))
    engine = Engine(EngineConfig(**config))
    draft_runner = engine.scheduler.proposer.runner
    execute, batch_sizes = draft_runner.execute, []

    def counting(batch):
        batch_sizes.append(len(batch.seqs))
        return execute(batch)

    draft_runner.execute = counting
    try:
        outputs = add_and_run(engine, requests)
    finally:
        engine.close()
    stats = engine.stats()
    assert {rid: tokens_of(outs) for rid, outs in outputs.items()} == plain
    assert stats["spec_decode_num_drafts_total"] > 0
    # the sequences proposing in a step share each draft forward
    assert max(batch_sizes) > 1 and sum(batch_sizes) > 2 * len(batch_sizes)
    proposer = engine.scheduler.proposer
    assert proposer.num_free_blocks == proposer.runner.num_kv_blocks, "the draft's KV blocks leaked"
    if target == draft:  # the draft is the target: every proposal is its greedy token
        assert _acceptance(stats) == 1.0
        steps = sum(1 for outs in outputs.values() for out in outs if out.new_token_ids)
        assert len(requests) * num_tokens / steps > 3.5, steps
    else:  # random weights of another shape: nearly every proposal is rejected, so k falls to 1 and backs off
        assert _acceptance(stats) < 0.2
        assert stats["spec_decode_num_draft_tokens_total"] < 4 * stats["spec_decode_num_drafts_total"]


def test_greedy_equal_with_chunked_prefill_prefix_hits_and_two_buffers(copy_model_dir):
    # a 24-token budget: prompts arrive in chunks beside verifying steps; the second wave repeats the first one's
    # prompts and extends them (prefix-cache hits in the target's pool; the draft's pool has its own K/V)
    prompts = _prompts(2, num_repeating=4, num_random=2)
    wave2 = {f"again-{rid}": [*p, 7, 8] for rid, p in prompts.items()}
    results = {}
    for spec in (None, _draft(copy_model_dir, k=3)):
        engine = Engine(EngineConfig(model=str(copy_model_dir), max_seq_len=256, num_kv_blocks=128,
                                     max_num_batched_tokens=24, num_buffers=2, speculative_config=spec))  # fmt: skip
        first = add_and_run(engine, _greedy(prompts, 32))
        second = add_and_run(engine, _greedy(wave2, 32))
        stats = engine.stats()
        engine.close()
        engine.block_manager.check_invariants([])
        assert stats["prefix_cache_hits_total"] > 0
        if spec is not None:
            assert _acceptance(stats) == 1.0 and stats["spec_decode_num_drafts_total"] > 10
        results[spec is None] = {rid: tokens_of(outs) for rid, outs in {**first, **second}.items()}
    assert results[True] == results[False]


def test_seeded_sampling_draws_the_same_tokens_with_a_draft_model(copy_model_dir):
    prompts = _prompts(5, num_repeating=3, num_random=1)
    requests = {rid: (p, SamplingParams(max_tokens=24, temperature=2.0, top_k=40, seed=i, ignore_eos=True))
                for i, (rid, p) in enumerate(prompts.items())}  # fmt: skip
    plain, _, _ = _run(copy_model_dir, requests)
    spec, _, stats = _run(copy_model_dir, requests, speculative_config=_draft(copy_model_dir))
    assert spec == plain and 0 < _acceptance(stats) < 1


def _start(target, draft) -> None:
    Engine(EngineConfig(model=str(target), max_seq_len=256, num_kv_blocks=16, speculative_config=_draft(draft)))


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    other = _write_small_model(tmp_path / "other", vocab_size=4096)
    with pytest.raises(ConfigError, match=r"vocabulary \(4096 tokens.*differs from the target's \(8192\)"):
        _start(tiny_model_dir, other)
    # the same size, another token -> id map
    tokenizer = json.loads((tmp_path / "other" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for f in (tmp_path / "other").iterdir():
        (swapped / f.name).write_bytes(f.read_bytes())
    config = json.loads((swapped / "config.json").read_text())
    (swapped / "config.json").write_text(json.dumps(config | {"vocab_size": 8192}))
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="maps tokens to other ids than the target's"):
        _start(tiny_model_dir, swapped)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        _start(tiny_model_dir, tmp_path)


def test_two_tensor_parallel_ranks_with_a_draft_equal_one_rank_without(copy_model_dir):
    # the draft runs on rank 0, on one rank of its own; the target's verifying rows go to both ranks
    requests = _greedy(_prompts(3, num_repeating=2, num_random=1), 24)
    plain, _, _ = _run(copy_model_dir, requests, num_threads=1)
    spec, _, stats = _run(copy_model_dir, requests, num_threads=1, tensor_parallel_size=2,
                          speculative_config=_draft(copy_model_dir))  # fmt: skip
    assert spec == plain and _acceptance(stats) == 1.0


def test_a_draft_that_mixes_sliding_and_full_layers_is_refused(built):
    """Its sliding layers' pool would need window block tables that a draft's sequences do not carry: refused at
    start-up, not failed under load."""
    gemma3, _ = built("gemma3")
    with pytest.raises(ConfigError, match="mixes sliding-window and full layers"):
        Engine(EngineConfig(model=str(gemma3), max_seq_len=128, num_kv_blocks=64, speculative_config=_draft(gemma3)))
