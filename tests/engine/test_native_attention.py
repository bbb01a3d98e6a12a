"""The native paged decode-attention kernel gives what plain softmax attention gives, and the runner gives the same
logits with it as with its torch ops."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.model import native
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

kernel = native.decode_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler: the runner uses torch ops")


def _reference(q_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q [H, D], k/v [L, KV, D] -> [H, D] by the textbook formula, in float64. In bf16 the softmax weights are
    rounded to bf16 before they multiply V, as transformers casts its fp32 softmax to the value dtype (the kernel
    rounds the unnormalised exponentials and divides by their exact sum at the end: the same weights up to the
    fp32 rounding of the division)."""
    group = q_row.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
    v_wide = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q_row.double(), k) * scale
    if softcap is not None:  # Gemma 2
        scores = torch.tanh(scores / softcap) * softcap
    top = scores.amax(-1, keepdim=True)
    if sinks is not None:  # gpt-oss: each head's sink in the denominator only
        top = torch.maximum(top, sinks.double().unsqueeze(-1))
    weights = (scores - top).exp()
    total = weights.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + (sinks.double().unsqueeze(-1) - top).exp()
    if v.dtype == torch.bfloat16:
        weights = weights.to(torch.bfloat16).double()
    return torch.einsum("hl,lhd->hd", weights / total, v_wide).float()


# bf16 output is rounded once from an fp32 sum: within half a bf16 ulp (2^-9 relative) of the exact value (the
# weights' own rounding is in the reference).
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 1e-3, "rtol": 2**-8}}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# head sizes 64 and 128 take the AVX-512 path where the CPU has it (80: the portable one everywhere); block sizes
# under, at and over its 16 positions per reduction; an odd one (no runner uses it) keeps bf16's V pass from pairing
# positions; groups of 7 (Qwen2.5-0.5B's 14 / 2 heads) and 6 (Qwen2.5-1.5B's 12 / 2, head size 128) split into the
# runs of heads bf16's V pass takes together (6 at size 64, 3 at 128)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (8, 8, 64, 16),
        (8, 2, 64, 16),
        (4, 1, 64, 8),
        (4, 2, 128, 32),
        (2, 2, 80, 16),
        (2, 1, 64, 5),
        (14, 2, 64, 16),
        (12, 2, 128, 16),
    ],
)
def test_kernel_matches_reference_on_scattered_blocks(heads, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    rng = random.Random(heads)
    num_blocks = 64
    k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 37]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    # Queries as a strided view (every other row of a wider matrix), as the runner slices them out of q/k rows.
    wide = torch.randn(2 * len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    q = wide[:, :heads]
    rows = [2 * i + 1 for i in range(len(lens))]
    out = torch.full((2 * len(lens), heads, head_dim), float("nan"), dtype=dtype)
    plan = native.DecodePlan(tables, lens, rows, block_size)
    scale = head_dim**-0.5
    kernel(q, k_pool, v_pool, plan, out, 0, 2, scale)  # two calls over disjoint sequence ranges
    kernel(q, k_pool, v_pool, plan, out, 2, len(lens), scale, threads=2)  # the range shared by two OpenMP threads
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        expected = _reference(q[rows[i]], k_pool[slots], v_pool[slots], scale)  # exact, on the same bf16 inputs
        torch.testing.assert_close(out[rows[i]].float(), expected, **TOLERANCE[dtype])
    assert torch.isnan(out[0::2]).all()  # rows that are not decodes stay untouched


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 256])  # the AVX-512 path where the CPU has it; the portable one (Gemma's)
def test_kernel_soft_caps_the_scores(dtype, head_dim):
    """Gemma 2: scaled scores s become cap * tanh(s / cap) before the softmax (a cap small enough to bend them)."""
    gen = torch.Generator().manual_seed(3)
    k_pool, v_pool = (torch.randn(64 * 16, 2, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = (torch.randn(2, 8, head_dim, generator=gen) * 3).to(dtype)
    lens, tables = [37, 70], [[5, 1, 9], [0, 2, 3, 4, 6]]
    out = torch.empty_like(q)
    kernel(q, k_pool, v_pool, native.DecodePlan(tables, lens, [0, 1], 16), out, 0, 2, 0.0625, softcap=2.0)
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n)])
        expected = _reference(q[i], k_pool[slots], v_pool[slots], 0.0625, softcap=2.0)
        torch.testing.assert_close(out[i].float(), expected, **TOLERANCE[dtype])
        uncapped = _reference(q[i], k_pool[slots], v_pool[slots], 0.0625)
        assert (uncapped - expected).abs().max() > 0.1  # the cap changes the result


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80])  # the AVX-512 path where the CPU has it; the portable one
def test_kernel_adds_each_heads_sink_to_its_softmax_denominator(dtype, head_dim):
    """gpt-oss: a logit per query head joins the denominator (and no value); sinks far above the scores (most of the
    weight goes to the sink), among them and below them, one of a context's first token."""
    gen = torch.Generator().manual_seed(4)
    k_pool, v_pool = (torch.randn(64 * 16, 2, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(3, 8, head_dim, generator=gen).to(dtype)
    sinks = torch.tensor([6.0, -3.0, 0.5, 1.0, 0.0, -0.7, 2.5, 40.0])
    lens, tables = [1, 37, 70], [[7], [5, 1, 9], [0, 2, 3, 4, 6]]
    out = torch.empty_like(q)
    kernel(q, k_pool, v_pool, native.DecodePlan(tables, lens, [0, 1, 2], 16), out, 0, 3, 0.125, sinks=sinks)
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n)])
        expected = _reference(q[i], k_pool[slots], v_pool[slots], 0.125, sinks=sinks)
        torch.testing.assert_close(out[i].float(), expected, **TOLERANCE[dtype])
        plain = _reference(q[i], k_pool[slots], v_pool[slots], 0.125)
        assert (plain - expected).abs().max() > 0.3  # the sinks change the result
    with pytest.raises(ValueError, match="sinks must be fp32"):
        kernel(q, k_pool, v_pool, native.DecodePlan(tables, lens, [0, 1, 2], 16), out, 0, 3, 0.125,
               sinks=sinks.to(torch.bfloat16))  # fmt: skip


@needs_kernel
def test_kernel_refuses_mixed_dtypes():
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    pool = torch.zeros(16, 4, 64)
    with pytest.raises(ValueError, match="must all be fp32 or all bf16"):
        kernel(q, pool, pool, native.DecodePlan([[0]], [1], [0], 16), torch.empty_like(q), 0, 1, 0.125)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_logits_same_with_native_kernels_and_torch_ops(tiny_model_dir: Path, dtype: str):
    config = EngineConfig(num_kv_blocks=128, max_seq_len=512, dtype=dtype)
    runner = ModelRunner(config, tiny_model_dir)
    torch_ops = ModelRunner(config, tiny_model_dir, native_ops=False)
    assert runner.attention.decode_kernel is not None and runner.ops is not None
    assert torch_ops.attention.decode_kernel is None and torch_ops.ops is None
    rng = random.Random(5)
    ids = list(range(runner.num_kv_blocks))
    rng.shuffle(ids)  # fragmented block tables
    tables = [ids[i * 4 : (i + 1) * 4] for i in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    prompts = [[rng.randrange(3, 8000) for _ in range(rng.randint(10, 50))] for _ in range(10)]
    fill = ModelInput([ScheduledSeq(f"r{i}", p[:-1], 0, tables[i], False, greedy) for i, p in enumerate(prompts)])
    runner.execute(fill)
    torch_ops.execute(fill)
    fresh = ScheduledSeq("fresh", prompts[0][:20], 0, tables[0], True, greedy)
    decodes = [ScheduledSeq(f"d{i}", p[-1:], len(p) - 1, tables[i], True, greedy, 1) for i, p in enumerate(prompts)]
    batch = ModelInput([fresh, *decodes[1:]])
    with_kernel = runner.compute_logits(batch)
    inputs = runner.prepare(batch)
    assert any(half.plan.kernel_plan is not None for half in inputs.halves or (inputs,))
    try:
        assert torch_ops.prepare(batch).plan.kernel_plan is None
        without = torch_ops.compute_logits(batch)
    finally:
        runner.close()
        torch_ops.close()
    if dtype == "float32":
        torch.testing.assert_close(with_kernel, without, atol=1e-4, rtol=1e-4)
    else:  # the torch ops round after every op, the kernels once: close, not equal
        torch.testing.assert_close(with_kernel.float(), without.float(), atol=0.1, rtol=0.05)
        agree = (with_kernel.argmax(-1) == without.argmax(-1)).float().mean().item()
        assert agree >= 0.9, f"top-1 agreement {agree:.2f}"


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_where_there_is_a_compiler_the_kernels_build():
    """The kernels' tests skip without a compiler; with one, a source that does not compile is a failure here."""
    assert kernel is not None and native.cpu_ops() is not None, "the native library did not build: see the warning"
    assert native._library("overlap_linear") is not None, "the projection kernel's library did not build"


def test_without_a_compiler_the_runner_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native._library.__wrapped__() is None
    assert "native kernels unavailable" in caplog.text and "using torch ops" in caplog.text
    monkeypatch.setenv("OVERLAP_NATIVE", "0")
    monkeypatch.delenv("CC")
    assert native._library.__wrapped__() is None
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").glob("*.so"))


@needs_kernel
def test_kernel_refuses_layouts_it_would_misread():
    pool = torch.zeros(32, 2, 64)
    plan = native.DecodePlan([[0]], [4], [0], 16)
    out = torch.empty(1, 4, 64)
    with pytest.raises(ValueError, match="dense"):
        kernel(torch.zeros(1, 64, 4).transpose(1, 2), pool, pool, plan, out, 0, 1, 0.125)
    with pytest.raises(ValueError, match="do not match"):
        kernel(torch.zeros(1, 4, 64), pool, pool, plan, torch.empty(1, 4, 32), 0, 1, 0.125)


def test_the_runner_names_its_kernels(tiny_model_dir: Path):
    config = EngineConfig(num_kv_blocks=32, max_seq_len=256, dtype="bfloat16")
    runner = ModelRunner(config, tiny_model_dir)
    torch_ops = ModelRunner(config, tiny_model_dir, native_ops=False)
    try:
        described = runner.kernels
        assert described.startswith(f"CPU {native.cpu_isa()} bfloat16:"), described
        expected = "native decode attention" if kernel is not None else "torch decode attention"
        assert expected in described
        assert ("native RMSNorm, RoPE, argmax" in described) == (kernel is not None)
        assert "torch decode attention" in torch_ops.kernels and "native RMSNorm" not in torch_ops.kernels
    finally:
        runner.close()
        torch_ops.close()
