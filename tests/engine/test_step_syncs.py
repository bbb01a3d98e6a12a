"""The GPU step path makes the host wait for nothing: no value read back (`.item()`, `.tolist()`, `bool(t)`, ...), no
op whose output size depends on the data (`nonzero`, `bincount`, ...), no pageable `torch.tensor(..., device=...)`
copy. On CPU every torch call of the step (prepare, forward, sample, the penalties' history, logprobs) goes through a
TorchFunctionMode that records those calls; on a GPU `bench/gpu/check.sh` runs the step loop under
`torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from overlap.engine.config import EngineConfig
from overlap.engine.model.builder import ensure_default_model
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

SYNCING = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
           "masked_select", "unique", "bincount", "repeat_interleave", "synchronize"}  # fmt: skip


class SyncSpy(TorchFunctionMode):
    """Records each torch call that would make the host wait for the device (kernel launches inside are skipped:
    Triton's interpreter reads its arguments on the host, a compiled kernel does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.where: list[str] = []  # the caller of each, to point at the line
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if not self.paused and (name in SYNCING or (name == "tensor" and kwargs.get("device") is not None)):
            self.found.append(name)
            caller = sys._getframe(1)
            self.where.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module", params=["triton", "torch"])
def runner(request):
    if request.param == "triton":
        pytest.importorskip("triton")
    config = EngineConfig(num_kv_blocks=64, max_seq_len=256, attention_backend=request.param)
    runner = ModelRunner(config, ensure_default_model(), cpu_paths=False)  # the paths CUDA takes
    # The steps' decodes attend to positions no prefill wrote: zeros there, not whatever the allocator left (a NaN
    # in it made the interpreter's matmul warn).
    with torch.inference_mode():
        runner.k_pool.zero_()
        runner.v_pool.zero_()
    yield runner
    runner.close()


def mixed_step(num_generated: int) -> ModelInput:
    """Decodes with every kind of sampling and logits control that runs on the device, and a prompt chunk."""
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0.7, top_p=0.9, seed=7),
        SamplingParams(temperature=1.0, logprobs=3),
        SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0, logit_bias=((5, 3.0), (9, -2.0)), min_tokens=8, bad_words_ids=((11,),)),
    ]
    prompt = list(range(3, 13))
    seqs = [ScheduledSeq(f"r{i}", [3 + i], 10 + num_generated, [i], True, p, num_generated, prompt_token_ids=prompt)
            for i, p in enumerate(kinds)]  # fmt: skip
    seqs.append(ScheduledSeq("chunk", list(range(20, 44)), 0, [10, 11], num_generated == 0, SamplingParams()))
    return ModelInput(seqs)


def test_a_step_reads_nothing_back(runner, monkeypatch):
    spy = SyncSpy()
    if runner.attention.triton is not None:  # the Triton kernels' module
        launch = runner.attention.triton.paged_attention

        def unwatched(*args, **kwargs):
            spy.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                spy.paused = False

        monkeypatch.setattr(runner.attention.triton, "paged_attention", unwatched)
    for step in range(3):  # the penalties' history grows from the second step on
        batch = mixed_step(step)
        with spy, torch.inference_mode():
            inputs = runner.prepare(batch)
            step = runner.device_step(inputs)
        assert step.tokens.shape == (len(inputs.sampling),) and step.logprobs is not None
    assert spy.found == [], spy.where


def test_a_step_verifying_proposals_reads_nothing_back(runner, monkeypatch):
    """Speculative decoding: rows per proposal, penalties over the proposals, acceptance on the device."""
    spy = SyncSpy()
    if runner.attention.triton is not None:
        launch = runner.attention.triton.paged_attention

        def unwatched(*args, **kwargs):
            spy.paused = True
            try:
                return launch(*args, **kwargs)
            finally:
                spy.paused = False

        monkeypatch.setattr(runner.attention.triton, "paged_attention", unwatched)
    for step in (1,):
        batch = mixed_step(step)
        for seq, k in zip(batch.seqs[:5], (3, 2, 0, 3, 1), strict=True):  # proposals for most of the decodes
            if k:
                seq.token_ids = seq.token_ids + [7, 8, 9][:k]
                seq.num_draft_tokens = k
        with spy, torch.inference_mode():
            inputs = runner.prepare(batch)
            result = runner.device_step(inputs)
        num_sampled = sum(1 for s in batch.seqs if s.do_sample)
        assert result.tokens.shape == (num_sampled,) and result.spec is not None
        assert len(inputs.sampling) == num_sampled + 3 + 2 + 3 + 1
    assert spy.found == [], spy.where


def test_the_spy_sees_a_read_back():
    spy = SyncSpy()
    with spy:
        x = torch.ones(3)
        bool(x.any())
        x.sum().item()
        torch.tensor([1], device="cpu")
    assert spy.found == ["__bool__", "item", "tensor"]
