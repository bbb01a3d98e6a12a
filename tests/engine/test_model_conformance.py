"""The conformance matrix: every supported family and variant (tests/support/hf_models.py) against transformers.

For each variant, a tiny random-weight model saved with `save_pretrained` is compared with transformers on prefill
logits, a packed batch over fragmented block tables, a chunked prompt, and greedy tokens, in fp32 on both the CPU
fast paths and the device-generic paths CUDA takes; through the engine with a prefix-cache hit; and in bf16 on the
top token. Each refusal is asserted with its message. docs/models.md tables what this covers.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.core import Engine
from overlap.engine.errors import ModelLoadError
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import FinishReason, ModelInput, SamplingParams, ScheduledSeq
from tests.support.engine import add_and_run, greedy_tokens, scattered_tables, tokens_of
from tests.support.hf_models import VARIANTS, VOCAB, edit_config, transformers_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=64)
PROMPT_LENS = (100, 37, 5, 64)  # 100 and 64 reach past the sliding windows (32)
# "triton": the device-generic paths with CUDA's attention, the Triton kernel, run in Triton's interpreter
PATHS = ("cpu", "device-generic", "triton")


pytestmark = pytest.mark.usefixtures("two_torch_threads")


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def _runner(folder: Path, path: str, dtype: str = "float32") -> ModelRunner:
    if path == "triton":
        pytest.importorskip("triton")
    backend = "triton" if path == "triton" else "auto"
    config = EngineConfig(num_kv_blocks=96, max_seq_len=512, block_size=16, dtype=dtype, attention_backend=backend)
    return ModelRunner(config, folder, cpu_paths=path == "cpu")


def _hf_last_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, -1].float()


# ---- the matrix -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", VARIANTS)
def test_packed_prefill_logits_match_transformers(built, name, path):
    folder, hf = built(name)
    runner = _runner(folder, path)
    prompts = _prompts()
    tables = scattered_tables([len(p) for p in prompts], runner.block_size, runner.num_kv_blocks)
    seqs = [ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    logits = runner.compute_logits(ModelInput(seqs))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], _hf_last_logits(hf, prompt), atol=1e-4, rtol=1e-4)


# The Triton path differs from the device-generic one only in its attention kernel: its chunked decode runs for the
# variants whose attention differs (windows, soft-capping and score scales, sinks, q/k norms, mixed layer types, experts
# beside it), which keeps the slowest column of the matrix short; its prefill logits run for every variant above.
TRITON_DECODE = {
    "llama",
    "mistral-sliding-window",
    "qwen2-sliding-layers",
    "qwen3",
    "qwen3-moe",
    "gemma2",
    "gemma3",
    "gpt-oss",
}
CHUNKED = [(name, path) for name in VARIANTS for path in PATHS if path != "triton" or name in TRITON_DECODE]


@pytest.mark.parametrize(("name", "path"), CHUNKED)
def test_chunked_prompts_then_greedy_decode_equal_transformers_generate(built, name, path):
    folder, hf = built(name)
    prompts = _prompts(seed=2)
    got = greedy_tokens(_runner(folder, path), prompts, 10, chunk=24)  # chunks cross the sliding windows' edges
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == transformers_greedy(hf, prompt, 10)


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_greedy_with_a_prefix_cache_hit_equals_transformers(built, name):
    folder, hf = built(name)
    engine = Engine(EngineConfig(model=str(folder), max_seq_len=512, num_kv_blocks=96, max_num_batched_tokens=48))
    prompt = _prompts(seed=3)[0]
    sampling = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = add_and_run(engine, {"a": (prompt, sampling)})["a"]
    again = add_and_run(engine, {"b": (prompt, sampling)})["b"]
    want = transformers_greedy(hf, prompt, 12)
    assert tokens_of(first) == want and tokens_of(again) == want
    assert first[-1].num_cached_tokens == 0 and again[-1].num_cached_tokens >= 64  # served from the cache


@pytest.mark.parametrize("name", VARIANTS)
def test_bfloat16_picks_transformers_bf16_top_token(built, name):
    from transformers import AutoModelForCausalLM

    folder, _ = built(name)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    runner = _runner(folder, "cpu", dtype="bfloat16")
    prompts = _prompts(seed=4)
    tables = scattered_tables([len(p) for p in prompts], runner.block_size, runner.num_kv_blocks)
    seqs = [ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    logits = runner.compute_logits(ModelInput(seqs))
    for i, prompt in enumerate(prompts):
        ref = _hf_last_logits(hf, prompt)
        # Top-1 agreement, up to bf16 rounding: where transformers' own top two lie within bf16's error of each
        # other, either is right.
        assert ref[logits[i].argmax()] >= ref.max() - 0.1, (i, float(ref.max() - ref[logits[i].argmax()]))


def test_sliding_window_serves_a_prompt_far_past_it_and_matches(built):
    """Mistral with window 32: a 200-token prompt is served (the window no longer caps the context)."""
    folder, hf = built("mistral-sliding-window")
    runner = _runner(folder, "cpu")
    assert runner.max_model_len == 512 and set(runner.spec.layer_windows) == {32}
    prompt = [random.Random(5).randrange(3, VOCAB) for _ in range(200)]
    assert greedy_tokens(runner, [prompt], 8, chunk=64)[0] == transformers_greedy(hf, prompt, 8)


def test_qwen2_sliding_layers_follow_layer_types(built):
    folder, _ = built("qwen2-sliding-layers")
    assert _runner(folder, "cpu").spec.layer_windows == [None, 32]  # max_window_layers=1: layer 0 attends fully


def test_dynamic_and_longrope_serve_up_to_their_original_context(built):
    assert _runner(built("llama-longrope")[0], "cpu").max_model_len == 128  # original_max_position_embeddings
    assert _runner(built("llama-dynamic-rope")[0], "cpu").max_model_len == 512


# ---- stopping -------------------------------------------------------------------------------------------------------
def _greedy_run(engine: Engine, prompt: list[int], n: int, **sampling) -> list:
    return add_and_run(engine, {"r": (prompt, SamplingParams(max_tokens=n, temperature=0, **sampling))})["r"]


def _first_fresh_tokens(tokens: list[int], count: int) -> list[tuple[int, int]]:
    """(index, token) of tokens that first appear at that index, skipping index 0."""
    seen, found = {tokens[0]}, []
    for i, t in enumerate(tokens[1:], 1):
        if t not in seen and t != 2:
            found.append((i, t))
        seen.add(t)
    return found[:count]


def test_llama3_style_two_eos_ids_stop_at_either(built, tmp_path):
    """generation_config.json lists two EOS ids, as Llama 3 Instruct ships <|end_of_text|> and <|eot_id|>."""
    folder, hf = built("llama3-rope")
    prompt = _prompts(seed=6)[1]
    free = transformers_greedy(hf, prompt, 24)
    (i, a), (j, b) = _first_fresh_tokens(free, 2)
    for eos_list, stop_at in (([a, b], i), ([b, 2], j)):
        copy = shutil.copytree(folder, tmp_path / f"eos-{stop_at}")
        (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_list, "bos_token_id": 1}))
        engine = Engine(EngineConfig(model=str(copy), max_seq_len=256, num_kv_blocks=64))
        assert engine.eos_token_ids >= set(eos_list)
        outs = _greedy_run(engine, prompt, 24)
        assert tokens_of(outs) == free[: stop_at + 1] and outs[-1].finish_reason == FinishReason.STOP
        outs = _greedy_run(engine, prompt, 24, ignore_eos=True)
        assert tokens_of(outs) == free and outs[-1].finish_reason == FinishReason.LENGTH


def test_config_eos_and_request_stop_ids_add_to_generation_config_eos(built, tmp_path):
    folder, hf = built("llama")
    prompt = _prompts(seed=7)[1]
    free = transformers_greedy(hf, prompt, 24)
    (i, a), (j, b) = _first_fresh_tokens(free, 2)
    copy = edit_config(shutil.copytree(folder, tmp_path / "m"), eos_token_id=b)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    engine = Engine(EngineConfig(model=str(copy), max_seq_len=256, num_kv_blocks=64))
    assert engine.eos_token_ids == {2, b}
    assert tokens_of(_greedy_run(engine, prompt, 24)) == free[: j + 1]  # config.json's id counts too
    assert tokens_of(_greedy_run(engine, prompt, 24, stop_token_ids=(a,))) == free[: i + 1]


def test_generation_config_sampling_defaults_are_read(built, tmp_path):
    folder, _ = built("llama")
    copy = shutil.copytree(folder, tmp_path / "m")
    (copy / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    engine = Engine(EngineConfig(model=str(copy), max_seq_len=256, num_kv_blocks=64))
    assert engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}


# ---- loading ----------------------------------------------------------------------------------------------------
def test_sharded_checkpoint_loads_through_its_index_and_ignores_consolidated(built, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    _, hf = built("qwen3")
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="100KB")
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 3
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    save_file({"output.weight": torch.zeros(3, 3)}, str(folder / "consolidated.safetensors"))  # Mistral's format
    prompt = _prompts()[0]
    logits = _runner(folder, "cpu").compute_logits(ModelInput([ScheduledSeq("a", prompt, 0, list(range(7)), True)]))
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(logits[0], _hf_last_logits(reloaded, prompt), atol=1e-4, rtol=1e-4)


def _refused(folder: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        _runner(folder, "cpu")


@pytest.mark.parametrize(
    ("architecture", "model_type", "reason"),
    [
        ("OlmoeForCausalLM", "olmoe", "mixture-of-experts family is not implemented"),
        ("Gemma3nForCausalLM", "gemma3n_text", "Gemma 3n"),
        ("Gemma3ForConditionalGeneration", "gemma3", "multimodal"),
        ("DeepseekV3ForCausalLM", "deepseek_v3", "DeepSeek"),
        ("LlavaForConditionalGeneration", "llava", "multimodal"),
        ("Qwen2VLForConditionalGeneration", "qwen2_vl", "multimodal"),
        ("FalconForCausalLM", "falcon", "not implemented"),
    ],
)
def test_unsupported_families_are_refused_by_name(built, tmp_path, architecture, model_type, reason):
    folder = shutil.copytree(built("llama")[0], tmp_path / "m")
    edit_config(folder, architectures=[architecture], model_type=model_type)
    _refused(folder, rf"{architecture}.*{reason}.*supported: LlamaForCausalLM, .*Phi3ForCausalLM")


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
            r"bitsandbytes \(NF4 / LLM\.int8\) weights are not supported",
        ),
        ({"hidden_act": "gelu_pytorch_tanh"}, r"hidden_act 'gelu_pytorch_tanh' is not supported"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 10000.0}}, r"RoPE type 'su' is not supported"),
        ({"layer_types": ["sliding_attention"]}, r"layer_types .* each of the 2 layers"),
    ],
)
def test_configs_the_runner_would_compute_wrongly_are_refused(built, tmp_path, changes, match):
    folder = edit_config(shutil.copytree(built("mistral-sliding-window")[0], tmp_path / "m"), **changes)
    _refused(folder, match)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_activation": "gelu"}, r"hidden_activation 'gelu' is not supported \(Gemma's MLP is GeGLU"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention .* is not supported"),
    ],
)
def test_gemma_configs_the_runner_would_compute_wrongly_are_refused(built, tmp_path, changes, match):
    _refused(edit_config(shutil.copytree(built("gemma2")[0], tmp_path / "m"), **changes), match)


def _with_tensors(src: Path, dst: Path, put: dict[str, torch.Tensor] | None = None, drop: str | None = None) -> Path:
    """A copy of the folder whose weights have `put` added or replaced and `drop` removed."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(src, dst)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(put or {})
    tensors.pop(drop or "", None)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_quantized_and_stray_tensors_are_refused_by_name(built, tmp_path):
    src = built("llama")[0]
    norm = "model.norm.weight"
    _refused(_with_tensors(src, tmp_path / "int8", {norm: torch.ones(64, dtype=torch.int8)}),
             r"'model\.norm\.weight' is torch\.int8.*quantized")  # fmt: skip
    _refused(_with_tensors(src, tmp_path / "gptq", {"model.layers.0.mlp.down_proj.qweight": torch.zeros(2, 2)}),
             r"'model\.layers\.0\.mlp\.down_proj\.qweight' belongs to a quantized checkpoint")  # fmt: skip
    _refused(_with_tensors(src, tmp_path / "stray", {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
             r"tensors LlamaForCausalLM does not use: model\.layers\.0\.self_attn\.q_norm\.weight")  # fmt: skip
    _refused(_with_tensors(src, tmp_path / "missing", drop="model.layers.1.mlp.up_proj.weight"),
             r"weight 'model\.layers\.1\.mlp\.up_proj\.weight' is missing")  # fmt: skip


def test_index_naming_a_missing_shard_is_refused(built, tmp_path):
    folder = tmp_path / "sharded"
    built("llama")[1].save_pretrained(folder, max_shard_size="100KB")
    next(folder.glob("model-*.safetensors")).unlink()
    _refused(folder, r"names shards that are not in the folder: model-")


def test_only_consolidated_weights_are_refused_with_a_hint(built, tmp_path):
    folder = shutil.copytree(built("llama")[0], tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "consolidated.safetensors")
    _refused(folder, r"consolidated\.safetensors is Mistral's own format")


@pytest.mark.parametrize(("variant", "dropped"), [
    ("gemma2", ["attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "head_dim",
                "query_pre_attn_scalar", "rope_parameters"]),
    ("gpt-oss", ["sliding_window", "head_dim", "rms_norm_eps", "rope_parameters"]),
    ("mixtral", ["rms_norm_eps", "rope_parameters"]),
])  # fmt: skip
def test_a_config_that_leaves_out_family_defaults_reads_as_transformers_reads_it(tmp_path, variant, dropped):
    """A trimmed config.json: where it leaves out a key its family's config class defaults (Gemma 2's soft-capping,
    window and head size, gpt-oss's window, head size and YaRN RoPE, Mixtral's norm epsilon and RoPE base), the
    engine reads transformers' value, not a default of its own."""
    from transformers import AutoConfig

    from overlap.engine.model.model_spec import read_spec, rope_tables
    from tests.support.hf_models import _variants

    config = _variants()[variant]().to_dict()
    config["architectures"] = [AutoConfig.for_model(config["model_type"]).__class__.__name__.replace(
        "Config", "ForCausalLM")]  # fmt: skip
    for key in [*dropped, "rope_theta", "rope_scaling", "layer_types"]:
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    spec = read_spec(tmp_path)
    assert spec.rms_norm_eps == hf.rms_norm_eps
    assert spec.head_dim == (hf.head_dim or hf.hidden_size // hf.num_attention_heads)
    if getattr(hf, "layer_types", None):
        assert spec.layer_windows == [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert spec.final_logit_softcapping == getattr(hf, "final_logit_softcapping", None)
    if variant == "gemma2":
        assert spec.attn_logit_softcapping == hf.attn_logit_softcapping == 50.0
        assert spec.query_pre_attn_scalar == hf.query_pre_attn_scalar
    cos, _ = rope_tables(spec, 8, tmp_path)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = hf.rope_parameters
    if rope["rope_type"] == "default":
        dim = spec.head_dim
        inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    angles = torch.arange(8, dtype=torch.float32)[:, None] * inv.float()[None, :]
    torch.testing.assert_close(cos, torch.cat([angles, angles], dim=-1).cos() * scaling)
