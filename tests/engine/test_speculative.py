"""Speculative decoding (docs/engine.md, "Speculative decoding"): vLLM's `--speculative-config` parsed and refused as
documented, and the ngram proposer's lookup."""

from __future__ import annotations

import argparse
import json

import pytest

from overlap.engine.batching.speculative import NgramProposer, propose_ngram
from overlap.engine.config import EngineConfig, add_engine_flags, engine_argv, engine_overrides
from overlap.engine.errors import ConfigError

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


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "eagle3", "num_speculative_tokens": 3, "model": "x"}, "EAGLE-3 heads are not implemented"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "EAGLE heads are not implemented"),
        ({"method": "draft_model", "model": "small", "num_speculative_tokens": 3}, "draft model is not implemented"),
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
    assert proposer.propose([1, 2, 3, 4, 5, 6, 1, 2], 16) == [3, 4, 5, 6]
    assert proposer.propose([1, 2, 3, 4, 5, 6, 1, 2], 2) == [3, 4]
