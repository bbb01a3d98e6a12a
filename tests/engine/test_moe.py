"""Mixtures of experts beyond the conformance matrix (which runs qwen3-moe, qwen2-moe, mixtral and gpt-oss like every
family; gpt-oss's own checks are in test_gpt_oss.py): router ties break as transformers breaks them; the Triton
fused-MoE kernels (gpt-oss's biases and clamped SwiGLU too), in Triton's interpreter, compute what the grouped torch
path does and, inside the runner, what transformers does; and a Qwen3-MoE at Qwen3-30B-A3B's real width (hidden
2048, 128 experts of 768, top-8), one layer deep, gives transformers' greedy tokens in fp32."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: the interpreter runs them on CPU
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.model.experts import ExpertWeights, MoeSpec
from overlap.engine.model.layers import moe as moe_layer
from overlap.engine.model.layers.linear import LinearBackend
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq
from tests.support.engine import greedy_tokens, scattered_tables
from tests.support.hf_models import VOCAB, transformers_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=16)

pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _prompts(lengths=(100, 37, 5, 64), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _runner(folder: Path, path: str = "cpu", **config) -> ModelRunner:
    backend = "triton" if path == "triton" else "auto"
    config = EngineConfig(**{"num_kv_blocks": 96, "max_seq_len": 512, "block_size": 16, "dtype": "float32",
                             "attention_backend": backend, **config})  # fmt: skip
    return ModelRunner(config, folder, cpu_paths=path == "cpu")


def _prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    tables = scattered_tables([len(p) for p in prompts], runner.block_size, runner.num_kv_blocks)
    seqs = [ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    return runner.compute_logits(ModelInput(seqs))


# ---- config.json -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model_type", "fields"),
    [
        # Qwen2-MoE's own sliding rule (every other layer below max_window_layers) where layer_types is absent, as
        # on the Hub; a dense layer every other one and one more by mlp_only_layers
        ("qwen2_moe", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], use_sliding_window=True,
                           sliding_window=32, max_window_layers=4)),
        ("qwen2_moe", dict(num_hidden_layers=3, sliding_window=4096)),  # no use_sliding_window: no window
        ("qwen3_moe", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=32, mlp_only_layers=[1])),
        ("qwen3_moe", dict(num_hidden_layers=2, sliding_window=4096, num_experts=6, num_experts_per_tok=3)),
        ("mixtral", dict(num_hidden_layers=2, sliding_window=64, num_local_experts=3)),
    ],
)  # fmt: skip
def test_moe_config_fields_are_read_as_transformers_reads_them(model_type, fields, tmp_path):
    """Sparse and dense layers, sliding windows, the expert count under either of its names, top-k."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from overlap.engine.model.model_spec import read_spec

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = AutoConfig.for_model(model_type, **shape, **fields)
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types", None)  # the Hub's Qwen2-MoE configs predate it
    if "num_local_experts" in raw and model_type == "qwen3_moe":
        raw["num_experts"] = raw.pop("num_local_experts")  # the Hub's spelling (transformers 5 saves the other)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    spec = read_spec(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert spec.moe.sparse == tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers)
    assert (spec.moe.num_experts, spec.moe.top_k) == (config.num_experts, config.num_experts_per_tok)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    expected = [config.sliding_window if t == "sliding_attention" and config.sliding_window else None for t in types]
    assert spec.layer_windows == expected


# ---- router ties ----------------------------------------------------------------------------------------------
def _record_engine_routes(runner: ModelRunner) -> list[list[torch.Tensor]]:
    """Per sparse layer, the expert ids [T, k] each of its calls picked."""
    routes = []
    for layer in runner.model.layers:
        if isinstance(layer.mlp, moe_layer.SparseMoE):
            calls: list[torch.Tensor] = []
            original = layer.mlp.route

            def recorded(x, original=original, calls=calls):
                weights, ids = original(x)
                calls.append(ids.clone())
                return weights, ids

            layer.mlp.route = recorded
            routes.append(calls)
    return routes


def test_tied_router_logits_pick_the_experts_transformers_picks(built, tmp_path):
    """Experts 2, 5 and 6 get the same router row in every layer, so their logits tie exactly for every token: where
    the tie straddles the top-2 boundary, torch.topk's order decides which of them run (not simply the lowest
    indices), in the engine as in transformers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = shutil.copytree(built("qwen3-moe")[0], tmp_path / "ties")
    tensors = load_file(str(folder / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.endswith("mlp.gate.weight"):
            tensor[2] *= 3  # larger logits: more often among the top ones
            tensor[5] = tensor[6] = tensor[2]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_routes = [[] for _ in hf.model.layers]
    for layer, calls in zip(hf.model.layers, hf_routes, strict=True):
        layer.mlp.gate.register_forward_hook(lambda module, args, out, calls=calls: calls.append(out[2].clone()))

    prompt = _prompts((90,), seed=8)[0]
    with torch.inference_mode():
        hf(torch.tensor([prompt]))
    runner = _runner(folder)
    routes = _record_engine_routes(runner)
    runner.compute_logits(ModelInput([ScheduledSeq("a", prompt, 0, list(range(6)), True, GREEDY)]))
    straddling = 0
    for ours, theirs in zip(routes, hf_routes, strict=True):  # the last layer runs only the sampled row
        assert torch.equal(ours[0], theirs[0][-len(ours[0]) :])
        picked = torch.stack([(ours[0] == e).any(dim=1) for e in (2, 5, 6)], dim=1).sum(dim=1)
        straddling += int(((picked > 0) & (picked < 3)).sum())  # some of the tied experts picked, not all
    assert straddling >= 5, straddling  # 13 of the 91 rows
    prompts = _prompts((30, 7), seed=9)
    assert greedy_tokens(runner, prompts, 8, chunk=16) == [transformers_greedy(hf, p, 8) for p in prompts]


# ---- the Triton kernels -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights_fp32", [False, True])  # Qwen's weights in the model dtype, Mixtral's in fp32
def test_fused_moe_kernels_equal_the_grouped_torch_path(dtype, weights_fp32):
    """Widths that are not multiples of the tiles (hidden 80, expert width 48), 1 to 70 tokens, every expert active
    or a few."""
    pytest.importorskip("triton")
    from overlap.engine.model.triton_moe import FusedMoE, align

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, top_k = 8, 80, 48, 2
    weights = ExpertWeights(router=(torch.randn(experts, hidden, generator=gen) * 0.3).to(dtype),
                            gate_up=(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(dtype),
                            down=(torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(dtype))  # fmt: skip
    spec = MoeSpec(experts, top_k, inter, norm_topk_prob=weights_fp32, weights_fp32=weights_fp32,
                   shared_intermediate_size=0, sparse=(True,), prefix="mlp")  # fmt: skip
    grouped = moe_layer.SparseMoE(weights, spec, LinearBackend())
    fused = FusedMoE(weights.gate_up, weights.down)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for rows in (1, 9, 70):
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        routing, ids = grouped.route(x)
        pairs, block_expert = align(ids, experts, 16)
        valid = pairs[pairs < rows * top_k]
        assert sorted(valid.tolist()) == list(range(rows * top_k))  # every pair once
        assert torch.equal(ids.reshape(-1)[valid.long()], block_expert.repeat_interleave(16)[pairs < rows * top_k])
        expected = grouped.grouped(x, routing, ids)
        got = fused(x, routing, ids)
        assert got.dtype == dtype and got.shape == (rows, hidden)
        torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_kernels_with_biases_and_the_clamped_swiglu_equal_the_grouped_torch_path(dtype):
    """gpt-oss's experts: gate|up and down biases (down's on one rank only: none here for half the cases) and the
    clamped SwiGLU with a limit that clamps about a third of the values; routing top-k first."""
    pytest.importorskip("triton")
    from overlap.engine.model.triton_moe import FusedMoE

    gen = torch.Generator().manual_seed(1)
    experts, hidden, inter, top_k = 4, 80, 48, 2
    for with_down_bias in (True, False):
        weights = ExpertWeights(router=(torch.randn(experts, hidden, generator=gen) * 0.3).to(dtype),
                                gate_up=(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype),
                                down=(torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(dtype),
                                router_bias=torch.randn(experts, generator=gen).to(dtype),
                                gate_up_bias=torch.randn(experts, 2 * inter, generator=gen).to(dtype),
                                down_bias=torch.randn(experts, hidden, generator=gen).to(dtype)
                                if with_down_bias else None)  # fmt: skip
        spec = MoeSpec(experts, top_k, inter, norm_topk_prob=False, weights_fp32=False, shared_intermediate_size=0,
                       sparse=(True,), prefix="mlp", topk_first=True, biases=True, fused=True,
                       activation="clamped_swiglu", swiglu=(1.702, 1.5))  # fmt: skip
        grouped = moe_layer.SparseMoE(weights, spec, LinearBackend())
        fused = FusedMoE(weights.gate_up, weights.down, weights.gate_up_bias, weights.down_bias, spec.swiglu)
        tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
        for rows in (1, 9, 70):
            x = torch.randn(rows, hidden, generator=gen).to(dtype)
            routing, ids = grouped.route(x)
            assert routing.dtype == dtype  # a softmax over the top-k logits, in their dtype
            torch.testing.assert_close(routing.sum(-1).float(), torch.ones(rows), atol=1e-2, rtol=0)
            got, expected = fused(x, routing, ids), grouped.grouped(x, routing, ids)
            torch.testing.assert_close(got.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral", "gpt-oss"])
def test_fused_moe_kernels_in_the_runner_match_transformers(built, name, monkeypatch):
    """The device paths with Triton (attention and experts), on the CPU in the interpreter: prefill logits of a
    packed batch equal transformers' in fp32."""
    pytest.importorskip("triton")
    monkeypatch.setattr(moe_layer, "FUSED_ON_CPU", True)
    folder, hf = built(name)
    runner = _runner(folder, "triton")
    assert any(getattr(layer.mlp, "fused", None) is not None for layer in runner.model.layers)
    prompts = _prompts((40, 23, 5))
    logits = _prefill_logits(runner, prompts)
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)


# ---- a real width ------------------------------------------------------------------------------------------------
def test_qwen3_moe_at_the_30b_a3b_width_gives_transformers_greedy_tokens(tmp_path):
    """Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of width 768, top-8
    renormalised), one layer deep, vocabulary cut to 2048; weights Normal(0, 0.02) stored in bf16, run in fp32 on the
    CPU paths (oneDNN, the native decode kernel). transformers' model gets the same numbers straight into its fused
    expert parameters (its from_pretrained would hold the layer three times over: 8 GB)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from overlap.engine.model import shapes

    config = {**shapes.shape_config("qwen3-30b-a3b"), "num_hidden_layers": 1, "vocab_size": 2048,
              "max_position_embeddings": 512}  # fmt: skip
    experts, hidden, width = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.empty(experts, 2 * width, hidden, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
    down = torch.empty(experts, hidden, width, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
    others = {}
    for name, shape in shapes._tensor_shapes(config).items():
        if ".experts." not in name:
            others[name] = (torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else
                            torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen))  # fmt: skip
    checkpoint = dict(others)
    for e in range(experts):
        expert = f"model.layers.0.mlp.experts.{e}."
        checkpoint |= {expert + "gate_proj.weight": gate_up[e, :width].clone(),
                       expert + "up_proj.weight": gate_up[e, width:].clone(),
                       expert + "down_proj.weight": down[e].clone()}  # fmt: skip
    folder = tmp_path / "qwen3-30b-a3b-1-layer"
    folder.mkdir()
    save_file(checkpoint, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    del checkpoint

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    state = {name: t.float() for name, t in others.items()}
    state |= {"model.layers.0.mlp.experts.gate_up_proj": gate_up.float(),
              "model.layers.0.mlp.experts.down_proj": down.float()}  # fmt: skip
    del gate_up, down, others
    hf.load_state_dict(state, strict=True, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)  # its buffers are not in the state: made here
    assert not [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    hf.eval()
    del state
    prompts = _prompts((12, 5), seed=11)
    expected = [transformers_greedy(hf, p, 4) for p in prompts]
    del hf
    runner = _runner(folder, max_seq_len=64, num_kv_blocks=8)
    assert runner.spec.moe.num_experts == 128 and runner.spec.moe.top_k == 8
    assert greedy_tokens(runner, prompts, 4, chunk=64) == expected
