"""The CPU runner's two-thread paths give the same numbers as one thread: a batch cut in two halves (one forward
per Python thread), and a lopsided batch run whole with the decode-attention helper thread."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.model.layers.linear import OneDnnBackend, pick_linear_backend
from overlap.engine.model.runner import ModelRunner
from overlap.engine.model.step_inputs import split_point
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    runner = ModelRunner(EngineConfig(num_kv_blocks=256, max_seq_len=2048), tiny_model_dir)
    yield runner
    runner.close()


def _decode(i: int, pos: int, table: list[int]) -> ScheduledSeq:
    return ScheduledSeq(f"d{i}", [7 + i], pos, table, True, GREEDY, 1)


def test_split_point_balances_work_and_skips_small_or_lopsided_batches():
    table = list(range(4))
    split = split_point
    assert split(ModelInput([_decode(0, 40, table)])) is None  # one sequence
    assert split(ModelInput([_decode(i, 10, table) for i in range(2)])) is None  # too little work
    assert split(ModelInput([_decode(i, 40, table) for i in range(64)])) == 32
    prompt = ScheduledSeq("p", list(range(3, 2003)), 0, list(range(130)), True, GREEDY)
    assert split(ModelInput([prompt] + [_decode(i, 40, table) for i in range(4)])) is None  # one long prompt
    chunks = [ScheduledSeq(f"p{i}", list(range(3, 131)), 0, table, True, GREEDY) for i in range(16)]
    assert split(ModelInput(chunks)) == 8


def _step_logits(runner: ModelRunner, batch: ModelInput, threads: int) -> tuple[torch.Tensor, bool]:
    torch.set_num_threads(threads)
    inputs = runner.prepare(batch)
    with torch.inference_mode():
        return runner.forward(inputs).float(), inputs.halves is not None


@pytest.mark.parametrize("fragmented", [False, True])
def test_halves_match_one_thread_on_a_mixed_batch(runner, fragmented):
    rng = random.Random(3)
    ids = list(range(runner.num_kv_blocks))
    if fragmented:
        rng.shuffle(ids)
    tables = [ids[i * 4 : (i + 1) * 4] for i in range(12)]  # 64 positions each
    prompts = [[rng.randrange(3, 8000) for _ in range(rng.randint(20, 40))] for _ in range(12)]
    # Fill the cache: every prompt but its last 8 tokens.
    fill = [ScheduledSeq(f"r{i}", p[:-8], 0, tables[i], False, GREEDY) for i, p in enumerate(prompts)]
    torch.set_num_threads(1)
    runner.execute(ModelInput(fill))
    # A chunk from position 0, a chunk continuing a prompt, and decodes (the last tokens stand in for sampled ones).
    fresh = ScheduledSeq("fresh", prompts[0][:30], 0, tables[0], True, GREEDY)
    chunk = ScheduledSeq("chunk", prompts[1][-8:], len(prompts[1]) - 8, tables[1], True, GREEDY)
    decodes = [
        ScheduledSeq(f"d{i}", [prompts[i][-8]], len(prompts[i]) - 8, tables[i], True, GREEDY, 1) for i in range(2, 12)
    ]
    batch = ModelInput([fresh, chunk, *decodes])
    split_logits, split = _step_logits(runner, batch, threads=2)
    whole_logits, whole_split = _step_logits(runner, batch, threads=1)
    assert split and not whole_split
    assert split_logits.shape == (12, runner.vocab_size)
    torch.testing.assert_close(split_logits, whole_logits, atol=1e-5, rtol=1e-5)


def test_lopsided_batch_uses_the_attention_helper_and_matches_one_thread(runner):
    rng = random.Random(4)
    tables = [list(range(i * 4, (i + 1) * 4)) for i in range(10)]
    contexts = [rng.randint(10, 50) for _ in range(10)]
    fill = [
        ScheduledSeq(f"r{i}", [rng.randrange(3, 8000) for _ in range(n)], 0, tables[i], False, GREEDY)
        for i, n in enumerate(contexts)
    ]
    torch.set_num_threads(1)
    runner.execute(ModelInput(fill))
    long_prompt = ScheduledSeq(
        "long", [rng.randrange(3, 8000) for _ in range(1500)], 0, list(range(100, 200)), True, GREEDY
    )
    decodes = [_decode(i, contexts[i], tables[i]) for i in range(10)]  # >= 8 decodes: the helper takes half
    batch = ModelInput([long_prompt, *decodes])
    two, split = _step_logits(runner, batch, threads=2)
    one, _ = _step_logits(runner, batch, threads=1)
    assert not split  # the long prompt is most of the work: run whole
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cpu_linear_is_onednn_and_matches_f_linear(dtype, tolerance):
    cpu = torch.device("cpu")
    assert not isinstance(pick_linear_backend(cpu, torch.float16), OneDnnBackend)
    backend = pick_linear_backend(cpu, dtype)
    # oneDNN has bf16 kernels only where the CPU has bf16 instructions (AVX512-BF16, AMX); an AVX2 CPU keeps F.linear
    has_kernels = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.backends.mkldnn.is_available():
        assert isinstance(backend, OneDnnBackend) == has_kernels
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((33, 300), (70, 300), (70,)))
    close = {"atol": tolerance, "rtol": tolerance}
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x, w, b)
        for weight in (w, backend.pack(w)):  # plain and (oneDNN) prepacked weights compute the same
            torch.testing.assert_close(backend.linear(x, weight, b).float(), expected.float(), **close)
            swish = backend.linear_silu(x, weight, b)
            torch.testing.assert_close(swish.float(), torch.nn.functional.silu(expected.float()), **close)
        plain = backend.linear(x[:, :200], w[:, :200]).float()
        torch.testing.assert_close(plain, (x[:, :200] @ w[:, :200].t()).float(), **close)


def _packed_weights(runner: ModelRunner) -> list[torch.Tensor]:
    layer = runner.model.layers[0]
    return [layer.qkv.weight, layer.o.weight, layer.mlp.gate.weight, layer.mlp.up.weight, layer.mlp.down.weight,
            runner.model.head.weight]  # fmt: skip


def test_bf16_cpu_runner_prepacks_its_projection_weights(tiny_model_dir):
    runner = ModelRunner(EngineConfig(num_kv_blocks=64, max_seq_len=256, dtype="bfloat16"), tiny_model_dir)
    try:
        if not isinstance(runner.linear, OneDnnBackend):
            pytest.skip("no oneDNN bf16 linear on this CPU / torch build")
        assert runner.model.layers[0].mlp.gate_up is None  # split into gate (SiLU fused) and up
        assert all(weight.layout == torch._mkldnn for weight in _packed_weights(runner))
    finally:
        runner.close()


def test_fp32_cpu_runner_prepacks_its_projection_weights(runner):
    if not isinstance(runner.linear, OneDnnBackend):
        pytest.skip("this torch build has no oneDNN linear")
    assert runner.model.layers[0].mlp.gate_up is None  # split into gate (SiLU fused) and up
    assert all(weight.layout == torch._mkldnn for weight in _packed_weights(runner))


def test_step_plan_auto_takes_halves_for_small_weights_and_for_large_ones_only_in_long_steps(tiny_model_dir,
                                                                                              monkeypatch):  # fmt: skip
    from overlap.engine.model import native
    from overlap.engine.model import runner as runner_module

    kernel = native.packed_linear_kernel()
    if kernel is not None:  # both plans' steps through the same kernel (on some CPUs 16 rows would go to oneDNN)
        monkeypatch.setattr(kernel, "rows", dict.fromkeys(kernel.rows, kernel.MAX_ROWS))

    def make(plan: str = "auto") -> ModelRunner:
        return ModelRunner(EngineConfig(num_kv_blocks=64, max_seq_len=256, cpu_step_plan=plan), tiny_model_dir)

    small = make()
    monkeypatch.setattr(runner_module, "HALVES_MAX_WEIGHT_BYTES", small.weight_bytes - 1)
    large, halves, whole = make(), make("halves"), make("whole")
    try:
        plans = [r.packer.halves_min_tokens for r in (small, large, halves, whole)]
        assert plans == [0, runner_module.HALVES_MIN_TOKENS, 0, None]
        assert "batch halves" in small.kernels and "halves for steps of 256+ tokens" in large.kernels
        torch.set_num_threads(2)
        decodes = ModelInput([_decode(i, 0, [i]) for i in range(16)])
        prompts = ModelInput([ScheduledSeq(f"p{i}", list(range(3, 131)), 0, list(range(8 * i, 8 * i + 8)), True,
                                           GREEDY)
                              for i in range(2)])  # fmt: skip
        assert [large.prepare(b).halves is not None for b in (decodes, prompts)] == [False, True]
        assert whole.prepare(prompts).halves is None
        split, run_whole = halves.prepare(decodes), whole.prepare(decodes)
        assert split.halves is not None and run_whole.halves is None
        with torch.inference_mode():  # the same step, run both ways, computes the same logits
            torch.testing.assert_close(whole.forward(run_whole).float(), halves.forward(split).float(), atol=1e-5,
                                       rtol=1e-5)  # fmt: skip
    finally:
        for r in (small, large, halves, whole):
            r.close()


def test_cpu_step_plan_is_checked():
    from overlap.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="cpu_step_plan must be auto\\|halves\\|whole"):
        EngineConfig(cpu_step_plan="thirds")
