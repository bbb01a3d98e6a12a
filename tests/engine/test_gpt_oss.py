"""gpt-oss beyond the conformance matrix (which runs the "gpt-oss" variant like every family): the variant's sinks and
SwiGLU clamps change transformers' own output (so the matrix would see them ignored); the MXFP4 layout of the released
checkpoints, written by tests/support/mxfp4.py and read by transformers itself, served equal to transformers; a
rank's share of the fused (float or MXFP4) experts; config.json as transformers reads it; what stays refused."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ModelLoadError
from overlap.engine.model.experts import dequantize_mxfp4
from overlap.engine.model.loader import load_weights
from overlap.engine.model.model_spec import read_spec
from overlap.engine.model.parallel import plan_shard, shard_spec
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq
from tests.support.engine import greedy_tokens, scattered_tables
from tests.support.hf_models import VOCAB, edit_config, save_variant, transformers_greedy
from tests.support.mxfp4 import mxfp4_folder, quantize

GREEDY = SamplingParams(temperature=0, max_tokens=16)

pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def variant(tmp_path_factory) -> Path:
    return save_variant("gpt-oss", tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def mxfp4(variant, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    return mxfp4_folder(variant, tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4")


def _prompts(lengths=(100, 37, 5, 64), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _hf(folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def _last_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0, -1]


def test_the_variants_sinks_and_clamps_change_what_transformers_computes(variant):
    """What the conformance matrix compares would differ by far more than its 1e-4 were the engine to drop the
    attention sinks or the SwiGLU clamps."""
    hf = _hf(variant)
    prompt = _prompts()[0]
    expected = _last_logits(hf, prompt)
    with torch.no_grad():
        sinks = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # a sink of weight 0: none
        assert (_last_logits(hf, prompt) - expected).abs().max() > 0.5
        for layer, kept in zip(hf.model.layers, sinks, strict=True):
            layer.self_attn.sinks.copy_(kept)
            layer.mlp.experts.limit = 1e9  # no clamp
        assert (_last_logits(hf, prompt) - expected).abs().max() > 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decodes_through_the_cpu_torch_ops_add_the_sinks(variant, dtype):
    """The CPU paths without the native kernel (attention_backend torch: no C compiler, or asked for) attend decodes
    with torch ops of their own (fp32: one streaming pass; bf16: two matmuls, the softmax in fp32): a decode step's
    logits there equal transformers' (fp32) and the native kernel's (bf16), at contexts inside and past the window."""
    prompts = _prompts((100, 37, 5), seed=2)
    logits = {}
    for backend in ("torch", "native"):
        runner = ModelRunner(EngineConfig(num_kv_blocks=96, max_seq_len=512, block_size=16, dtype=dtype,
                                          attention_backend=backend), variant)  # fmt: skip
        assert (runner.attention.decode_kernel is None) == (backend == "torch")
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
        runner.execute(ModelInput([ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY)
                                   for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]))  # fmt: skip
        decodes = [ScheduledSeq(f"r{i}", [7], len(p), t, True, GREEDY, 1)
                   for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]  # fmt: skip
        logits[backend] = runner.compute_logits(ModelInput(decodes)).float()
    if dtype == "float32":
        hf = _hf(variant)
        for i, prompt in enumerate(prompts):
            torch.testing.assert_close(logits["torch"][i], _last_logits(hf, [*prompt, 7]), atol=1e-4, rtol=1e-4)
    else:  # two bf16 roundings of the attention apart: within a few bf16 steps of logits of size ~5
        torch.testing.assert_close(logits["torch"], logits["native"], atol=0.1, rtol=0.02)


# ---- MXFP4 -------------------------------------------------------------------------------------------------------
def test_the_mxfp4_helper_packs_what_transformers_and_the_engine_dequantize():
    """The test helper's blocks and scales, read by transformers' own dequantization (integrations/mxfp4.py, plain
    torch) and by the engine's, give the values the helper meant; and on arbitrary bytes (every code, in both nibbles,
    scales 2^-20 .. 2^20) the engine's dequantization is transformers'."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 40, 96, generator=gen) * torch.logspace(-3, 1, 96)  # [E, out, in], blocks of all sizes
    blocks, scales, values = quantize(weight)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3) and blocks.dtype == scales.dtype == torch.uint8
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out], as the parameters are
    assert torch.equal(theirs.transpose(1, 2), values)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), values)
    assert (values - weight).abs().max() <= weight.abs().max() / 4  # within half a step of the coarsest code

    raw = torch.randint(0, 256, (2, 5, 4, 16), generator=gen, dtype=torch.uint8)
    raw[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, in both nibbles
    exponents = torch.randint(127 - 20, 127 + 21, (2, 5, 4), generator=gen, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(raw, exponents, dtype=dtype).transpose(1, 2)
        assert torch.equal(dequantize_mxfp4(raw, exponents, dtype), theirs)


def test_the_engine_on_an_mxfp4_folder_equals_transformers_on_it(mxfp4):
    """The folder as the released checkpoints lay it out (blocks, scales, quantization_config), loaded by transformers
    with its own dequantization (Mxfp4Config(dequantize=True): plain torch, on the CPU) and by the engine, which
    dequantizes the experts at load: prefill logits of a packed batch and greedy tokens under chunked prefill."""
    from transformers import Mxfp4Config

    folder, expected = mxfp4
    hf = _hf(folder, quantization_config=Mxfp4Config(dequantize=True))
    parameters = dict(hf.named_parameters())
    assert all(torch.equal(parameters[name], values) for name, values in expected.items())  # what the helper meant
    runner = ModelRunner(EngineConfig(num_kv_blocks=96, max_seq_len=512, block_size=16, dtype="float32"), folder)
    assert runner.spec.quantization.method == "mxfp4" and "MXFP4" in runner.kernels
    prompts = _prompts()
    tables = scattered_tables([len(p) for p in prompts], runner.block_size, runner.num_kv_blocks)
    seqs = [ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    logits = runner.compute_logits(ModelInput(seqs))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], _last_logits(hf, prompt), atol=1e-4, rtol=1e-4)
    prompts = _prompts((40, 9), seed=1)
    assert greedy_tokens(runner, prompts, 10, chunk=24) == [transformers_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("packed", [False, True], ids=["float", "mxfp4"])
def test_each_rank_reads_its_share_of_the_fused_experts(tmp_path, packed):
    """Expert width 96 over 2 ranks: rank 1's 48 columns start inside an MXFP4 block of 32. Each rank's gate, up and
    down (and biases) are its slice of what one process reads; only rank 0 holds the down biases."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=3,
                          num_experts_per_tok=2, initializer_range=0.2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    folder = tmp_path / "float"
    model.save_pretrained(folder)
    if packed:
        folder, _ = mxfp4_folder(folder, tmp_path / "mxfp4")
    spec = read_spec(folder)
    whole = load_weights(spec, folder, torch.float32, torch.device("cpu")).layers[0]
    width = 96 // 2
    for rank in (0, 1):
        shard = plan_shard(spec, rank, 2)
        part = load_weights(spec, folder, torch.float32, torch.device("cpu"), shard).layers[0]
        assert shard_spec(spec, shard).moe.intermediate_size == width
        cols = slice(rank * width, (rank + 1) * width)
        gate, up = whole.moe.gate_up[:, :96], whole.moe.gate_up[:, 96:]
        assert torch.equal(part.moe.gate_up, torch.cat([gate[:, cols], up[:, cols]], dim=1))
        assert torch.equal(part.moe.down, whole.moe.down[:, :, cols])
        gate_b, up_b = whole.moe.gate_up_bias[:, :96], whole.moe.gate_up_bias[:, 96:]
        assert torch.equal(part.moe.gate_up_bias, torch.cat([gate_b[:, cols], up_b[:, cols]], dim=1))
        assert torch.equal(part.sinks, whole.sinks[rank * 2 : rank * 2 + 2])
        assert (part.moe.down_bias is not None) == (rank == 0)
    # and one process's layout is transformers' parameters de-interleaved: gate at even columns, up at odd ones
    params = dict(model.named_parameters()) if not packed else None
    if params is not None:
        fused = params["model.layers.0.mlp.experts.gate_up_proj"]  # [E, H, 2 I]
        assert torch.equal(whole.moe.gate_up[:, :96], fused[..., 0::2].transpose(1, 2))
        assert torch.equal(whole.moe.gate_up[:, 96:], fused[..., 1::2].transpose(1, 2))


# ---- config.json -------------------------------------------------------------------------------------------------
def test_config_fields_are_read_as_transformers_reads_them(variant, tmp_path):
    """Without layer_types, every other layer slides from the first (GptOssConfig's rule); attention_bias defaults
    to on; swiglu_alpha and swiglu_limit as written, else 1.702 and 7.0; the expert count under either name."""
    from transformers import AutoConfig

    folder = edit_config(shutil.copytree(variant, tmp_path / "m"), layer_types=None, swiglu_alpha=None,
                         swiglu_limit=None, attention_bias=None, num_hidden_layers=3)  # fmt: skip
    raw = json.loads((folder / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    (folder / "config.json").write_text(json.dumps(raw))
    config = AutoConfig.from_pretrained(folder)
    spec = read_spec(folder)
    assert spec.layer_windows == [32 if t == "sliding_attention" else None for t in config.layer_types]
    assert spec.layer_windows == [32, None, 32]
    assert spec.qkv_bias and spec.o_bias and config.attention_bias
    assert spec.moe.swiglu == (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    assert (spec.moe.num_experts, spec.moe.top_k) == (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert spec.attention_sinks and spec.moe.topk_first and spec.moe.biases


def test_other_quantized_formats_and_mxfp4_elsewhere_are_refused(variant, tmp_path):
    from overlap.engine.model import shapes

    w4a16 = shapes.shape_config("qwen2.5-0.5b", "w4a16")["quantization_config"]
    folder = edit_config(shutil.copytree(variant, tmp_path / "w4a16"), quantization_config=w4a16)
    with pytest.raises(ModelLoadError, match=r"GptOssForCausalLM quantized as compressed-tensors .* not supported"):
        read_spec(folder)
    llama = save_variant("llama", tmp_path / "llama")
    edit_config(llama, quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ModelLoadError, match=r"MXFP4 weights are supported for gpt-oss's experts only"):
        read_spec(llama)
    with pytest.raises(ModelLoadError, match=r"--quantization fp8 was asked for, but .* holds a mxfp4 checkpoint"):
        read_spec(edit_config(shutil.copytree(variant, tmp_path / "asked"), quantization_config={
            "quant_method": "mxfp4"}), "fp8")  # fmt: skip


# ---- a real width ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # 15-25 s on 2 cores: 230M parameters written, read by both, run in fp32
def test_gpt_oss_20b_at_its_real_width_gives_transformers_logits_and_greedy_tokens(tmp_path, monkeypatch):
    """gpt-oss-20b's widths (hidden 2880, 64 heads of 64 over 8 KV heads, experts of 2880, top-4, window 128, its
    YaRN) from `overlap model build-shape`'s recipe, cut to one sliding layer, 8 experts and a vocabulary of 2048;
    biases, sinks and norms drawn wide (the recipe's zeros and ones leave them untested). On a 160-token prompt (past
    the window), in fp32: the last position's logits, and greedy tokens after a prefill in chunks, equal
    transformers'."""
    from safetensors.torch import load_file, save_file

    from overlap.engine.model import shapes

    monkeypatch.setenv("OVERLAP_CACHE_DIR", str(tmp_path))
    cut = {**shapes.SHAPES["gpt-oss-20b"], "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
           "num_local_experts": 8, "vocab_size": 2048}  # fmt: skip
    monkeypatch.setitem(shapes.SHAPES, "test-gpt-oss", cut)
    folder = shapes.ensure_shape_model("test-gpt-oss")
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        spread = 2.0 if name.endswith(("norm.weight", "sinks")) else 0.5 if name.endswith("bias") else None
        if spread is not None:
            tensors[name] = (torch.randn(tensor.shape, generator=gen) * spread).bfloat16()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    prompt = [int(t) for t in torch.randint(3, 2048, (160,), generator=gen)]
    reference = _hf(folder)
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    want = transformers_greedy(reference, prompt, 4)
    del reference
    runner = ModelRunner(EngineConfig(model=str(folder), max_seq_len=256, num_kv_blocks=16, dtype="float32"), folder)
    try:
        assert runner.spec.layer_windows == [128] and runner.spec.moe.top_k == 4
        greedy = SamplingParams(temperature=0, max_tokens=1)
        logits = runner.compute_logits(ModelInput([ScheduledSeq("a", prompt, 0, list(range(13)), True, greedy)]))[0]
        tokens = greedy_tokens(runner, [prompt], 4, chunk=64)[0]
    finally:
        runner.close()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert tokens == want
