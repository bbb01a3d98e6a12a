"""EngineConfig.simulated_device: the model folder's shape (vocabulary, EOS, context) on the simulated device."""

from __future__ import annotations

import json
import time

import pytest

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.errors import ConfigError
from overlap.engine.model.sim_runner import SimRunner
from overlap.engine.types import RequestSpec, SamplingParams


def test_serves_the_model_folders_shape_in_the_profiles_time(tiny_model_dir):
    config = EngineConfig(simulated_device={"fixed_s": 0.01, "per_token_s": 0.0}, max_seq_len=512)
    engine = Engine(config, model_dir=tiny_model_dir)
    assert isinstance(engine.runner, SimRunner) and engine.runner.step_mode == "launch"
    model_config = json.loads((tiny_model_dir / "config.json").read_text())
    assert engine.vocab_size == model_config["vocab_size"]
    assert engine.eos_token_ids == {model_config["eos_token_id"]}
    assert engine.max_model_len == 512
    engine.add_request(RequestSpec("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
    started = time.perf_counter()
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 20 and all(0 <= t < engine.vocab_size for t in tokens)
    assert time.perf_counter() - started >= 20 * 0.01  # one step per token, each the profile's 10 ms


@pytest.mark.parametrize(
    "bad", [{"fixed_s": -1, "per_token_s": 0}, {"fixed_s": 0.1}, {"fixed_s": "x", "per_token_s": 0}, [0.1, 0]]
)
def test_a_bad_profile_is_refused_with_its_shape(bad):
    with pytest.raises(ConfigError, match=r"simulated_device must be \{fixed_s"):
        EngineConfig(simulated_device=bad)
