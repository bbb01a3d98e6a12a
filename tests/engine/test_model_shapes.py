"""Models of real families' shapes with random weights (`overlap model build-shape`): the tensors are the real
checkpoints' (checked against transformers' own model of each config, on the meta device: no memory), and a built
folder loads in transformers and in the engine with the same logits, every id of its padded vocabulary decoding."""

from __future__ import annotations

import json

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError
from overlap.engine.model import shapes
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq


@pytest.mark.parametrize("name", list(shapes.SHAPES))
def test_each_shape_has_the_tensors_transformers_builds_for_its_config(name):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = shapes.shape_config(name)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    # the names save_pretrained writes (a mixture of experts' fused expert parameters split back per expert)
    expected = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    if config["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    assert shapes._tensor_shapes(config) == expected
    assert shapes.num_parameters(config) == model.num_parameters()


def test_an_unknown_shape_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"unknown model shape 'qwen9'; choose from qwen2\.5-0\.5b"):
        shapes.shape_config("qwen9")


def test_a_built_shape_loads_alike_in_transformers_and_the_engine(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    small = {**shapes.SHAPES["qwen2.5-0.5b"], "vocab_size": 9000, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "test-qwen2", small)
    lines = []
    folder = shapes.ensure_shape_model("test-qwen2", progress=lines.append)
    assert folder == tmp_path / "shapes" / f"test-qwen2-{shapes.RECIPE}" and lines[-1].startswith("built test-qwen2")
    assert shapes.ensure_shape_model("test-qwen2") == folder  # cached: built once
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 9000
    assert not [p for p in tmp_path.joinpath("shapes").iterdir() if p.name.startswith(".")]  # no leftovers

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode([8999]) == "<|extra_8999|>"  # a padded id decodes
    ids = tokenizer("def f(x): return x")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    runner = ModelRunner(EngineConfig(model=str(folder), max_seq_len=128, num_kv_blocks=8), folder)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=1)
        logits = runner.compute_logits(ModelInput([ScheduledSeq("a", ids, 0, [0, 1], True, greedy, 0)]))[0]
    finally:
        runner.close()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_mixture_of_experts_shape_is_written_in_shards_and_loads_alike(tmp_path, monkeypatch):
    """Qwen3-30B-A3B's recipe at a small width, written in shards with their index (as its 61 GB must be): the
    engine's logits equal transformers' on the same folder."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shapes, "SHARD_BYTES", 300_000)
    small = {**shapes.SHAPES["qwen3-30b-a3b"], "vocab_size": 600, "hidden_size": 64, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "test-qwen3-moe", small)
    folder = shapes.ensure_shape_model("test-qwen3-moe")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1 and not (folder / "model.safetensors").exists()
    assert shapes.ensure_shape_model("test-qwen3-moe") == folder  # complete: its index counts as the weights
    with pytest.raises(ConfigError, match="gpt-oss's experts are fused"):
        shapes.shape_config("gpt-oss-20b", "w4a16")
    # quantized as llm-compressor writes it: every expert's projections, not the routers; all of it read, the
    # experts kept in int8 for the format's kernel
    quantized = shapes.ensure_shape_model("test-qwen3-moe", quantization="w8a8")
    runner = ModelRunner(EngineConfig(model=str(quantized), max_seq_len=128, num_kv_blocks=8), quantized)
    try:
        assert "experts: W8A8" in runner.linear_kernels, runner.linear_kernels
    finally:
        runner.close()

    ids = [5, 17, 300, 2, 44, 599]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    runner = ModelRunner(EngineConfig(model=str(folder), max_seq_len=128, num_kv_blocks=8), folder)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=1)
        logits = runner.compute_logits(ModelInput([ScheduledSeq("a", ids, 0, [0, 1], True, greedy, 0)]))[0]
    finally:
        runner.close()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_gemma3_1b_at_its_real_width_gives_transformers_logits_and_greedy_tokens(tmp_path, monkeypatch):
    """Gemma 3 1B's widths (hidden 1152, MLP 6912, 4 heads of 256 over 1 KV head, window 512) from its hub config.json
    (4.x spelling: rope_local_base_freq, sliding_window_pattern), the depth cut to one sliding and one full layer and
    the vocabulary to 9000. On a 600-token prompt (past the window), in fp32: the last position's logits, and greedy
    tokens after a prefill in chunks, equal transformers'."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.support.engine import greedy_tokens
    from tests.support.hf_models import transformers_greedy

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    cut = {**shapes.SHAPES["gemma-3-1b"], "num_hidden_layers": 2, "sliding_window_pattern": 2, "vocab_size": 9000}
    monkeypatch.setitem(shapes.SHAPES, "test-gemma3", cut)
    folder = shapes.ensure_shape_model("test-gemma3")
    # Norm weights drawn wide: with the shape's unit norms this random model greedily repeats one token
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("norm.weight")]:
        tensors[name] = (torch.randn(tensors[name].shape, generator=gen) * 2).bfloat16()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [int(t) for t in torch.randint(3, 9000, (600,), generator=gen)]
    runner = ModelRunner(EngineConfig(model=str(folder), max_seq_len=640, num_kv_blocks=48, dtype="float32"), folder)
    try:
        assert runner.spec.layer_windows == [512, None]
        greedy = SamplingParams(temperature=0, max_tokens=1)
        logits = runner.compute_logits(ModelInput([ScheduledSeq("a", prompt, 0, list(range(38)), True, greedy)]))[0]
        tokens = greedy_tokens(runner, [prompt], 8, chunk=256)[0]
    finally:
        runner.close()
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert tokens == transformers_greedy(reference, prompt, 8)
