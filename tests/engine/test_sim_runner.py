"""The simulated device: cost model, exact busy intervals, GIL release, history-dependent tokens through the pool."""

from __future__ import annotations

import threading
import time

import pytest

from overlap.engine.errors import ConfigError
from overlap.engine.model.sim_runner import CostModel, SimRunner
from overlap.engine.types import ModelInput, ScheduledSeq


def seq(request_id, tokens, start, blocks, do_sample=True):
    return ScheduledSeq(request_id, list(tokens), start, list(blocks), do_sample)


def test_cost_model_arithmetic_and_fit(tmp_path):
    cost = CostModel.for_step(4.0, 64, per_token_us=10)
    assert cost.step_s(64) == pytest.approx(0.004)
    assert cost.step_s(0) == pytest.approx(0.004 - 64e-5)
    fitted = CostModel.fit([(n, 0.002 + 3e-5 * n) for n in (1, 16, 64, 128)])
    assert fitted.fixed_s == pytest.approx(0.002) and fitted.per_token_s == pytest.approx(3e-5)
    path = tmp_path / "profile.json"
    fitted.save(path)
    assert CostModel.load(path) == fitted


@pytest.mark.parametrize(
    "make",
    [
        lambda: CostModel(-1.0, 0.0),
        lambda: CostModel(0.0, float("nan")),
        lambda: CostModel.for_step(1.0, 64, per_token_us=100),
        lambda: CostModel.fit([(8, 0.1), (8, 0.2)]),
    ],
)
def test_cost_model_rejects_bad_values(make):
    with pytest.raises(ConfigError):
        make()


def test_cost_model_bad_profile_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"fixed_s": 1}')
    with pytest.raises(ConfigError, match="cannot read cost profile"):
        CostModel.load(path)


def test_busy_interval_is_the_cost_models_time():
    runner = SimRunner(CostModel(0.010, 0.0001), block_size=4, num_kv_blocks=16)
    output = runner.execute(ModelInput([seq("a", range(3, 23), 0, range(5))]))  # 20 tokens
    assert len(output.token_ids) == 1
    start, end = output.busy
    assert end - start == pytest.approx(0.010 + 20 * 0.0001, abs=2e-4)  # the interval is the cost model's, exactly
    assert runner.num_steps == 1 and runner.busy_s_total == pytest.approx(end - start)


def test_forward_releases_the_gil():
    runner = SimRunner(CostModel(0.2, 0.0), block_size=4, num_kv_blocks=4)
    worker = threading.Thread(target=runner.execute, args=(ModelInput([seq("a", [5], 0, [0])]),))
    start = time.perf_counter()
    worker.start()
    count = 0
    while worker.is_alive():  # pure-Python work on this thread while the device "runs"
        count += 1
    elapsed = time.perf_counter() - start
    worker.join()
    assert elapsed < 2.0  # a 0.2 s step: generous, so a loaded CI machine cannot fail it
    assert count > 10_000, "the host thread could not run while the simulated device was busy"


def test_tokens_follow_the_history_through_the_paged_pool():
    runner = SimRunner(CostModel(0.0, 0.0), vocab_size=97, block_size=4, num_kv_blocks=32)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    expected = runner.reference_tokens(prompt, 6)
    blocks = [9, 3, 17, 4]
    # chunked prefill (4 + 3 tokens), then decodes feeding back each sampled token
    assert runner.execute(ModelInput([seq("a", prompt[:4], 0, blocks, do_sample=False)])).token_ids == []
    out = runner.execute(ModelInput([seq("a", prompt[4:], 4, blocks)])).token_ids
    for _ in range(5):
        pos = len(prompt) + len(out) - 1
        out += runner.execute(ModelInput([seq("a", [out[-1]], pos, blocks)])).token_ids
    assert out == expected
    # another sequence in the same batch as a decode of the first keeps its own history
    more = runner.execute(ModelInput([seq("b", [5, 6, 7, 9], 0, [20]), seq("a", [out[-1]], 12, blocks)])).token_ids
    assert more == runner.reference_tokens([5, 6, 7, 9], 1) + runner.reference_tokens(prompt, 7)[6:]


def test_reused_block_changes_the_tokens():
    """A block overwritten by another request (freed too early) must show up as different tokens."""
    runner = SimRunner(CostModel(0.0, 0.0), vocab_size=1000, block_size=4, num_kv_blocks=8)
    prompt = [3, 4, 5, 6, 7, 8]
    first = runner.execute(ModelInput([seq("a", prompt, 0, [0, 1])])).token_ids
    runner.execute(ModelInput([seq("b", [9, 9, 9, 9, 9, 9], 0, [2, 1])]))  # overwrites block 1's slots
    wrong = runner.execute(ModelInput([seq("a", first, len(prompt), [0, 1])])).token_ids
    assert wrong != runner.reference_tokens(prompt, 2)[1:]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (seq("a", [], 0, [0]), "at least one token"),
        (seq("a", [1, 2, 3, 4, 5], 0, [0]), "block table covers"),
        (seq("a", [10_000], 0, [0]), "outside the vocabulary"),
        (seq("a", [1], 0, [99]), "outside the pool"),
        (seq("a", [1], 3, [0]), "KV slot for position 2"),
    ],
)
def test_malformed_batches_are_rejected(bad, message):
    runner = SimRunner(CostModel(0.0, 0.0), block_size=4, num_kv_blocks=4)
    with pytest.raises(ValueError, match=message):
        runner.execute(ModelInput([bad]))
