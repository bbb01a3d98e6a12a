"""Quantized checkpoints against their producers and consumers.

- compressed-tensors checkpoints written by llm-compressor itself (tests/support/quantized_models.py): greedy tokens
  (8 prompts x 32) and prefill logits equal transformers loading the same folder with compressed-tensors, in fp32.
  FP8 runs on the CPU with weights dequantized at load and 16-bit activations, so its reference is transformers on
  the same folder with the activations' FP8 rounding switched off; W8A8 keeps its int8 activations on both sides.
  W4A16 with zero points, which this transformers / compressed-tensors pair cannot load, is compared with a float
  model holding compressed-tensors' own decompressed weights.
- GPTQ (in order and act-order, with and without zero points) and AWQ checkpoints packed by
  tests/support/handwritten_checkpoints.py, whose packing is checked first against the formats' reference unpacking
  (AutoAWQ's `dequantize_gemm`, GPTQModel's `unpack_rows` / `unpack_cols` and its v1 zero-point correction, read from
  their released sources); then greedy tokens equal transformers on the weights the codes stand for; and under
  tensor parallelism 2. Block-FP8 (`quant_method: fp8`, 128x128 `weight_scale_inv`) folders written there too equal
  transformers loading the same folder (which dequantizes them on a CPU).
- Mixtures of experts with every expert quantized (through the format's kernel; FP8 dequantized at load):
  Qwen3-MoE as llm-compressor writes it (W4A16, FP8_DYNAMIC) and in block FP8 against transformers on the same
  folder; Mixtral and Qwen2-MoE (its shared expert) in GPTQ against transformers on their dequantized weights, and
  under tensor parallelism 2.
- The GPU path's kernels (Triton's W4A16 / W8A16 / FP8, run in its interpreter; FP8 `torch._scaled_mm`, which torch
  also runs on a CPU) against the dequantized weight.
- Each bad input is refused with the tensor or field it trips on.
"""

from __future__ import annotations

import ast
import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError, ModelLoadError
from overlap.engine.model.quant import formats
from overlap.engine.model.quant.kernels import Int8DynamicReference, quantized_method
from overlap.engine.model.quant.weight import QuantizedWeight
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq
from tests.support import handwritten_checkpoints, quantized_models
from tests.support.engine import greedy_tokens
from tests.support.hf_models import transformers_greedy

pytestmark = [pytest.mark.usefixtures("two_torch_threads"), pytest.mark.slow]
GREEDY = SamplingParams(temperature=0, max_tokens=64)
VOCAB = 512
# One family per scheme keeps `make test` short; `quantized_models.build` makes any other pair.
COMPRESSED = [("llama", "W4A16"), ("qwen2", "W4A16_G32"), ("qwen3", "W8A16"), ("qwen2", "W8A8"), ("llama", "W8A8"),
              ("qwen3", "FP8_DYNAMIC"), ("llama", "FP8")]  # fmt: skip


def _prompts(seed: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 70))] for _ in range(count)]


def _runner(folder: Path, **config) -> ModelRunner:
    return ModelRunner(EngineConfig(num_kv_blocks=160, max_seq_len=256, block_size=16, **config), folder)


def _assert_conforms(folder: Path, hf, seed: int, *, rtol: float, **config) -> None:
    """8 prompts x 32 greedy tokens equal, and each prompt's last logits within `rtol` of the largest logit."""
    prompts = _prompts(seed)
    runner = _runner(folder, **config)
    try:
        got = greedy_tokens(runner, prompts, 32, chunk=256)
        tables = [list(range(8 * i, 8 * i + 5)) for i in range(len(prompts))]
        seqs = [ScheduledSeq(f"r{i}", p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
        logits = runner.compute_logits(ModelInput(seqs))
    finally:
        runner.close()
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(logits[i].float(), ref, atol=rtol * float(ref.abs().max()), rtol=0)
        assert got[i] == transformers_greedy(hf, prompt, 32), f"prompt {i}"


# ---- compressed-tensors, from llm-compressor --------------------------------------------------------------------
@pytest.fixture(scope="module")
def compressed():
    return {pair: quantized_models.build(*pair) for pair in [*COMPRESSED, ("llama", "W4A16_ASYM")]}


@pytest.mark.parametrize("pair", COMPRESSED, ids=lambda p: "-".join(p).lower())
def test_compressed_tensors_checkpoint_equals_transformers_on_the_same_folder(compressed, pair):
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM

    folder = compressed[pair]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if pair[1].startswith("FP8"):  # the CPU computes FP8 weights in 16 bits: no FP8 rounding of the activations
        hf.apply(disable_quantization)
    # W8A8: int32 sums here, float sums of the same int8 codes there
    _assert_conforms(folder, hf, seed=len(pair[1]), rtol=1e-2 if pair[1] == "W8A8" else 1e-4)


@pytest.mark.parametrize("pair", [("llama", "W4A16"), ("qwen2", "W8A8"), ("qwen3_moe", "W4A16"),
                                  ("qwen3_moe", "FP8_DYNAMIC")], ids=lambda p: "-".join(p).lower())  # fmt: skip
def test_overlap_serve_gives_transformers_tokens_on_a_folder_llm_compressor_wrote(pair):
    """The folder as llm-compressor saved it (with a word tokenizer: token i is `t<i>`), served by `overlap serve`
    over HTTP, the prompt given as token ids: the completion's tokens are transformers' greedy tokens on the same
    folder (a mixture of experts' too, every expert 4-bit or FP8; FP8 against transformers with its FP8 rounding of
    activations off, as the CPU computes FP8 weights in 16 bits)."""
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM

    from tests.support.sidecar import http, overlap_serve

    folder = quantized_models.build(*pair)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if pair[1].startswith("FP8"):
        hf.apply(disable_quantization)
    prompts = _prompts(21, count=3)
    with overlap_serve(folder, "engine.yaml", "max_seq_len: 256\n", "--dtype", "float32") as served:
        for prompt in prompts:
            body = {"model": served["model"], "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "echo": True}  # fmt: skip
            status, _, answer = http("POST", served["url"] + "/v1/completions", body, timeout=120)
            assert status == 200, answer
            # the prompt's and the completion's text, token i written `t<i>` (joined with or without spaces)
            ids = [int(i) for i in re.findall(r"t(\d+)", answer["choices"][0]["text"])]
            assert ids[: len(prompt)] == prompt
            assert ids[len(prompt) :] == transformers_greedy(hf, prompt, 16)


def _dense_reference(folder: Path, weights: dict[str, torch.Tensor]):
    """transformers' float model of `folder`'s config (no quantization) holding `weights` (the rest from the file)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    config.quantization_config = None
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items() if k.endswith(
        ("norm.weight", "embed_tokens.weight", "lm_head.weight", ".bias"))}  # fmt: skip
    missing, _ = hf.load_state_dict({**state, **weights}, strict=False)
    assert not [m for m in missing if "rotary" not in m], missing
    return hf


def test_compressed_tensors_asymmetric_w4a16_equals_its_decompressed_weights(compressed):
    """transformers 5.25 with compressed-tensors 0.19 cannot load zero points (a shape mismatch in its load report),
    so the reference is compressed-tensors' own decompressor, module by module, in a float model."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    folder = compressed[("llama", "W4A16_ASYM")]
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    assert not scheme.weights.symmetric
    tensors = load_file(str(folder / "model.safetensors"))
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
    weights = {}
    for module in modules:
        local = {k[len(module) + 1 :]: v for k, v in tensors.items() if k.startswith(module + ".")}
        local["weight_scale"] = local["weight_scale"].float()  # it dequantizes in the scale's dtype: fp32, as here
        weights[module + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    _assert_conforms(folder, _dense_reference(folder, weights), seed=7, rtol=1e-4)


def test_the_engine_names_the_format_and_its_kernels(compressed):
    runner = _runner(compressed[("llama", "W4A16")], dtype="bfloat16")
    try:
        assert runner.spec.quantization.method == "compressed-tensors"
        assert "W4A16 (pack-quantized, group 128, symmetric)" in runner.kernels
        assert "W4A16 native" in runner.kernels  # quant_w4a16.c, checked against the dequantized weight at load
        # its kernels use every thread in each call: no step runs as two half-batch forwards side by side
        assert "whole batch on all threads" in runner.kernels
        # the streaming floor counts 4-bit codes: well under the bf16 size of the same projections
        spec = runner.spec
        h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
        bf16_projections = 2 * spec.num_layers * (h * (spec.num_heads + 2 * spec.num_kv_heads) * d + h * d *
                                                  spec.num_heads + 3 * h * i)  # fmt: skip
        assert runner.weight_bytes < bf16_projections / 2 + 2 * 2 * VOCAB * h
    finally:
        runner.close()


# ---- GPTQ and AWQ, packed here, checked against the formats' reference unpacking ---------------------------------
def _reference_sources() -> Path:
    """AutoAWQ's and GPTQModel's released sources (sdists from PyPI, no install), once in Overlap's cache folder."""
    from overlap.engine.model.builder import cache_root

    root = cache_root() / "test-tools" / "quant-references"
    if not (root / ".done").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                        str(root), "autoawq==0.2.9", "gptqmodel==7.7.0"], check=True)  # fmt: skip
        for archive in root.glob("*.tar.gz"):
            with tarfile.open(archive) as tar:
                tar.extractall(root, filter="data")
        (root / ".done").touch()
    return root


def _functions(path: Path, names: list[str], namespace: dict) -> dict:
    """The named top-level functions of a released source file, run as they are (their module's other imports
    are not needed by them)."""
    tree = ast.parse(path.read_text())
    chosen = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    exec(compile(ast.Module(body=chosen, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def references():
    root = _reference_sources()
    awq = _functions(root / "autoawq-0.2.9/awq/utils/packing_utils.py",
                     ["unpack_awq", "reverse_awq_order", "dequantize_gemm"],
                     {"torch": torch, "AWQ_REVERSE_ORDER": [0, 4, 1, 5, 2, 6, 3, 7]})  # fmt: skip
    gptq = _functions(root / "gptqmodel-7.7.0/gptqmodel/utils/model_dequant.py",
                      ["unpack_cols", "pack_cols", "unpack_rows", "_shift_gptq_qzeros", "_correct_gptq_v1_qzeros"],
                      {"torch": torch, "PLANAR_BITS": frozenset()})  # fmt: skip
    return awq, gptq


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_packing_equals_gptqmodels_unpacking(references, desc_act, symmetric):
    _, ref = references
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    tensors, dequantized = handwritten_checkpoints.gptq_tensors(weight, 32, desc_act, symmetric)
    # GPTQModel's convert_gptq_file: v1 zero points corrected, rows and columns unpacked, scale and zero per g_idx
    zeros = ref["unpack_cols"](ref["_correct_gptq_v1_qzeros"](tensors["qzeros"], 4), 4)
    codes = ref["unpack_rows"](tensors["qweight"], 4)
    g_idx = tensors["g_idx"].long()
    theirs = ((codes.float() - zeros.float()[g_idx]) * tensors["scales"].float()[g_idx]).t()
    torch.testing.assert_close(theirs, dequantized, atol=0, rtol=0)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": symmetric}
    ours = formats.parse({"quantization_config": qc}, Path("config.json")).read(
        lambda name: tensors.get(name.rsplit(".", 1)[-1]), "m", 96, 256, Path("m"))  # fmt: skip
    assert (ours.perm is not None) == desc_act
    torch.testing.assert_close(ours.dequantize(torch.float32), theirs, atol=0, rtol=0)


def test_awq_packing_equals_autoawqs_dequantize_gemm(references):
    ref, _ = references
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    tensors, dequantized = handwritten_checkpoints.awq_tensors(weight, 64)
    theirs = ref["dequantize_gemm"](tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), 4, 64).t()
    torch.testing.assert_close(theirs, dequantized, atol=0, rtol=0)
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    ours = formats.parse({"quantization_config": qc}, Path("config.json")).read(
        lambda name: tensors.get(name.rsplit(".", 1)[-1]), "m", 96, 256, Path("m"))  # fmt: skip
    torch.testing.assert_close(ours.dequantize(torch.float32), theirs, atol=0, rtol=0)


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory) -> Path:
    """A small random Llama (widths that 32, 64 and 128 divide), saved as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("dense")
    model.save_pretrained(folder)
    return folder


GPTQ_AWQ = {
    "gptq-g128-sym": dict(method="gptq", group=128, symmetric=True),
    "gptq-g32-asym-act-order": dict(method="gptq", group=32, desc_act=True, symmetric=False),
    "awq-g64": dict(method="awq", group=64),
}


@pytest.fixture(scope="module")
def packed(dense_folder, tmp_path_factory):
    out = {}
    for name, args in GPTQ_AWQ.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = folder, handwritten_checkpoints.write(dense_folder, folder, **args)
    return out


@pytest.mark.parametrize("name", GPTQ_AWQ)
def test_gptq_and_awq_checkpoints_equal_transformers_on_their_dequantized_weights(packed, name):
    folder, weights = packed[name]
    _assert_conforms(folder, _dense_reference(folder, weights), seed=11, rtol=1e-4)


@pytest.fixture(scope="module")
def block_fp8(dense_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fp8-block")
    handwritten_checkpoints.write(dense_folder, folder, method="fp8", group=128)
    return folder


def test_block_fp8_checkpoint_equals_transformers_on_the_same_folder(block_fp8):
    """DeepSeek-V3 / Qwen3-FP8's layout: transformers' fine-grained FP8 loader dequantizes it on a CPU, as here."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(block_fp8, dtype=torch.float32).eval()
    _assert_conforms(block_fp8, hf, seed=12, rtol=1e-4)
    runner = _runner(block_fp8, dtype="bfloat16")
    try:
        assert "fp8 (128x128 block scales) through" in runner.kernels
        assert "(dequantized at load)" in runner.kernels  # no CPU computes in FP8
    finally:
        runner.close()


@pytest.mark.parametrize("name", ["gptq-g128-sym", "fp8-block", "gptq-g32-asym-act-order"])
def test_under_tensor_parallelism_2_equals_one_rank(packed, block_fp8, name):
    """Codes, scales and zero points (act-order's column order, FP8's block scales) sharded with rows and groups.
    Act-order groups span the whole input, so the o and down projections' shards split them: those two are
    dequantized at load, the rest stay 4-bit."""
    folder = block_fp8 if name == "fp8-block" else packed[name][0]
    prompts = _prompts(13, count=4)
    runners = [_runner(folder, tensor_parallel_size=size, num_threads=1) for size in (1, 2)]
    try:
        one, two = (greedy_tokens(r, prompts, 16, chunk=256) for r in runners)
        per_rank = runners[1].weight_bytes / runners[0].weight_bytes  # rank 0's codes, scales and zero points
    finally:
        for r in runners:
            r.close()
    assert one == two
    if name != "gptq-g32-asym-act-order":  # there two shards are float
        assert 0.45 <= per_rank <= 0.55, f"rank 0 of 2 holds {per_rank:.3f} of the weight bytes"


# ---- mixtures of experts: every expert quantized ------------------------------------------------------------------
MOE_SIZE = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # fmt: skip


def _moe_dense_folder(config, folder: Path) -> Path:
    """A random mixture of experts saved by transformers (one tensor per expert and projection), its logits and
    routers spread so that neither greedy tokens nor top-k experts hang on near-ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(10.0)
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.mul_(50.0)
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC"])
def test_quantized_experts_from_llm_compressor_equal_transformers_on_the_same_folder(scheme):
    """Qwen3-MoE as llm-compressor writes it (each expert's gate, up and down a compressed-tensors module, the
    routers left in float). transformers holds the decompressed experts in the scales' bfloat16, the engine exactly
    in float32 (the same rounding when serving in bfloat16): hence W4A16's wider logit tolerance; tokens equal."""
    from compressed_tensors.quantization.lifecycle.helpers import disable_quantization
    from transformers import AutoModelForCausalLM

    folder = quantized_models.build("qwen3_moe", scheme)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if scheme.startswith("FP8"):  # the experts compute in 16 bits: no FP8 rounding of the activations
        hf.apply(disable_quantization)
    _assert_conforms(folder, hf, seed=21, rtol=2e-3 if scheme == "W4A16" else 1e-4)
    runner = _runner(folder)
    try:  # 4 bits through the format's kernel, expert by expert; FP8 (no CPU computes in it) dequantized at load
        experts = runner.linear_kernels.rsplit("; experts: ", 1)[1]
        assert (experts == "dequantized at load") == scheme.startswith("FP8"), runner.linear_kernels
    finally:
        runner.close()


def test_block_fp8_experts_equal_transformers_on_the_same_folder(tmp_path_factory):
    """Qwen3-30B-A3B-FP8's layout (every expert's projections in 128x128-block FP8, `weight_scale_inv`) on a small
    Qwen3-MoE: transformers' fine-grained FP8 loader dequantizes it on a CPU, as the engine does."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**MOE_SIZE, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    dense = _moe_dense_folder(config, tmp_path_factory.mktemp("qwen3-moe"))
    folder = tmp_path_factory.mktemp("qwen3-moe-fp8-block")
    handwritten_checkpoints.write(dense, folder, method="fp8", group=128)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _assert_conforms(folder, hf, seed=22, rtol=1e-4)


def _gptq_moe_config(family: str):
    from transformers import MixtralConfig, Qwen2MoeConfig

    if family == "mixtral":
        return MixtralConfig(**MOE_SIZE, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)
    # the shared expert's gate, up and down quantized too (its sigmoid gate, like the router, left in float)
    return Qwen2MoeConfig(**MOE_SIZE, intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                          num_experts_per_tok=2, shared_expert_intermediate_size=256)  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_gptq_experts_equal_transformers_on_their_dequantized_weights(family, tmp_path_factory):
    """Mixtral as the Hub's GPTQ releases hold it (`block_sparse_moe.experts.E.w1|w3|w2.qweight`, the router in
    float; here one expert's gate in float too) and Qwen2-MoE with its shared expert: transformers on a float folder of
    the weights the codes stand for. Split across two ranks (each expert's gate and up rows, down columns, of its
    codes), the same tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    dense = _moe_dense_folder(_gptq_moe_config(family), tmp_path_factory.mktemp(family))
    folder = tmp_path_factory.mktemp(f"{family}-gptq")
    weights = handwritten_checkpoints.write(dense, folder, method="gptq", group=128)
    if family == "mixtral":  # one expert left in float (the first, whose layout the others must not be read by)
        module = "model.layers.0.block_sparse_moe.experts.0.w1"
        path = folder / "model.safetensors"
        tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith(module)}
        save_file({**tensors, f"{module}.weight": weights[f"{module}.weight"].contiguous()}, str(path))
    reference = tmp_path_factory.mktemp(f"{family}-dequantized")
    save_file({name: t.contiguous() for name, t in weights.items()}, str(reference / "model.safetensors"))
    shutil.copy(dense / "config.json", reference / "config.json")
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    _assert_conforms(folder, hf, seed=23, rtol=1e-4)
    prompts = _prompts(24, count=4)
    runners = [_runner(folder, tensor_parallel_size=size, num_threads=1) for size in (1, 2)]
    try:
        if family != "mixtral":  # there the first expert's float layout is the layer's
            assert "experts: W4A16" in runners[0].linear_kernels, runners[0].linear_kernels
        one, two = (greedy_tokens(r, prompts, 16, chunk=256) for r in runners)
    finally:
        for r in runners:
            r.close()
    assert one == two


def test_a_shard_that_splits_quantization_groups_is_refused_with_the_sizes():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (8, 128), generator=gen, dtype=torch.uint8)
    weight = QuantizedWeight(codes, torch.rand(8, 4, generator=gen), torch.full((8, 4), 8.0), 4, 32, "test")
    assert weight.columns(32, 96, "o_proj").shape == (8, 64)
    with pytest.raises(ModelLoadError, match=r"o_proj: a tensor-parallel shard takes input columns \[0, 48\), which "
                                             r"splits its quantization groups of 32"):  # fmt: skip
        weight.columns(0, 48, "o_proj")
    # act-order: a group's columns anywhere in the input, so a shard splits groups and comes back dequantized
    perm = torch.randperm(128, generator=gen)
    ordered = QuantizedWeight(codes, weight.scale, weight.zero, 4, 32, "test", perm=perm)
    shard = ordered.columns(0, 64, "o_proj")
    assert isinstance(shard, torch.Tensor)
    torch.testing.assert_close(shard, ordered.dequantize(torch.float32)[:, :64])


# ---- kernels against the dequantized reference ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group", "act_bits", "symmetric"),
                         [(4, 128, None, True), (4, 32, None, False), (8, None, None, True), (8, None, 8, True),
                          (8, 64, None, True)])  # fmt: skip
def test_each_cpu_kernel_computes_what_the_dequantized_weight_does(dtype, bits, group, act_bits, symmetric):
    gen = torch.Generator().manual_seed(3)
    n, k = 160, 256
    group = group or k
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    zero = torch.full_like(scale, 2.0 ** (bits - 1)) if symmetric else torch.randint(0, 2**bits, scale.shape).float()
    weight = QuantizedWeight(codes, scale, zero, bits, group, "test", act_bits=act_bits, dtype=dtype)
    method = quantized_method(weight, dtype, cpu_paths=True)
    if (bits, group) == (8, 64):  # grouped 8-bit: no CPU kernel, dequantized at load instead
        assert method is None
        return
    x = torch.randn(7, k, generator=gen).to(dtype)
    with torch.inference_mode():
        got = method(x).float()
        want = (Int8DynamicReference(weight, torch.float32)(x.float()) if act_bits
                else x.float() @ weight.dequantize(torch.float32).t())  # fmt: skip
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance * float(want.abs().max()), rtol=tolerance)


@pytest.mark.parametrize("onednn", [False, True], ids=["native", "onednn-above-16"])
@pytest.mark.parametrize("rows", [3, 40, 300])
def test_w8a8_takes_every_step_size_with_per_token_int8_activations(rows, onednn, monkeypatch):
    """The native kernel at every size; and where oneDNN keeps a copy for larger steps (AMX, or no VNNI), both."""
    from overlap.engine.model.quant import kernels
    from overlap.engine.model.quant.kernels import NativeW8A8

    monkeypatch.setattr(kernels, "_keeps_onednn", lambda kernel: onednn)

    gen = torch.Generator().manual_seed(8)
    n, k = 96, 320
    codes = torch.randint(1, 256, (n, k), generator=gen, dtype=torch.uint8)
    weight = QuantizedWeight(codes, torch.rand(n, 1, generator=gen) * 0.01, torch.full((n, 1), 128.0), 8, k, "test",
                             act_bits=8)  # fmt: skip
    x = torch.randn(rows, k, generator=gen)
    want = Int8DynamicReference(weight, torch.float32)(x)
    method = NativeW8A8(weight, torch.float32)
    assert (method.onednn is not None) == onednn and method.nbytes >= (2 if onednn else 1) * n * k
    torch.testing.assert_close(method(x), want, atol=1e-4, rtol=1e-4)


def test_weights_past_the_native_kernels_limits_still_get_a_kernel():
    """W8A8 wider than the native kernel's int32 sums take (MAX_K inputs) runs through oneDNN; W4A16 groups above
    the probe's 256 inputs, or that do not divide them, still get the native kernel."""
    from overlap.engine.model import native
    from overlap.engine.model.quant.kernels import NativeW4A16, NativeW8A8

    gen = torch.Generator().manual_seed(6)
    n, k = 16, native.QuantLinearKernel.MAX_K + 64
    codes = torch.randint(1, 256, (n, k), generator=gen, dtype=torch.uint8)
    wide = QuantizedWeight(codes, torch.rand(n, 1, generator=gen) * 1e-3, torch.full((n, 1), 128.0), 8, k, "test",
                           act_bits=8)  # fmt: skip
    method = quantized_method(wide, torch.float32, cpu_paths=True)
    assert not isinstance(method, NativeW8A8)
    x = torch.randn(2, k, generator=gen)
    torch.testing.assert_close(method(x), Int8DynamicReference(wide, torch.float32)(x), atol=1e-3, rtol=1e-3)
    if native.quant_linear_kernel() is None:
        return
    for k, group in ((1024, 512), (768, 96)):
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = torch.rand(n, k // group, generator=gen) * 0.01
        weight = QuantizedWeight(codes, scale, torch.full_like(scale, 8.0), 4, group, "test")
        method = quantized_method(weight, torch.float32, cpu_paths=True)
        assert isinstance(method, NativeW4A16), (k, group)
        x = torch.randn(3, k, generator=gen)
        want = x @ weight.dequantize(torch.float32).t()
        torch.testing.assert_close(method(x), want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


def test_a_bf16_w4a16_kernel_takes_fp32_x_too():
    """On AVX512-BF16 the kernel built for a bf16 model holds offsets for bf16 x: fp32 x goes in as bf16."""
    from overlap.engine.model import native
    from overlap.engine.model.quant.kernels import NativeW4A16

    if native.quant_linear_kernel() is None:
        pytest.skip("no native kernel built here")
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (32, 256), generator=gen, dtype=torch.uint8)
    scale = torch.rand(32, 2, generator=gen) * 0.01
    weight = QuantizedWeight(codes, scale, torch.full_like(scale, 8.0), 4, 128, "test")
    method = NativeW4A16(weight, torch.bfloat16)
    x = torch.randn(4, 256, generator=gen)
    got = method(x)
    want = x.to(torch.bfloat16).float() @ weight.dequantize(torch.float32).t()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)


# ---- refusals ---------------------------------------------------------------------------------------------------
def _copy(folder: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def _edit_quantization(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def test_a_missing_scale_is_refused_by_name(compressed, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(compressed[("llama", "W4A16")], tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    missing = "quantized weight 'model.layers.1.mlp.down_proj.weight_scale' is missing"
    with pytest.raises(ModelLoadError, match=missing):
        _runner(folder)


def test_a_group_size_that_does_not_divide_the_inputs_is_refused(compressed, tmp_path):
    folder = _copy(compressed[("llama", "W4A16")], tmp_path)
    _edit_quantization(folder, lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=96))
    with pytest.raises(ModelLoadError, match="group size 96 does not divide its 256 inputs"):
        _runner(folder)


def test_quantization_flag_refuses_a_checkpoint_of_another_format(compressed, packed, dense_folder):
    with pytest.raises(ModelLoadError, match=r"--quantization gptq was asked for, but .* holds a compressed-tensors"):
        _runner(compressed[("llama", "W8A8")], quantization="gptq")
    with pytest.raises(ModelLoadError, match=r"--quantization awq was asked for, but .* no quantization_config"):
        _runner(dense_folder, quantization="awq")
    expected = "quantization must be compressed-tensors|fp8|gptq|awq|mxfp4, got 'int3'"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        EngineConfig(quantization="int3")
    runner = _runner(packed["awq-g64"][0], quantization="awq")
    assert runner.spec.quantization.method == "awq"
    runner.close()


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes .* are not supported"),
    ({"quant_method": "gguf"}, "GGUF weights are not supported"),
    ({"quant_method": "exl2"}, "EXL2 weights are not supported"),
    ({"quant_method": "hqq"}, "HQQ weights are not supported"),
    ({"quant_method": "magic"}, "quant_method 'magic' are not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with bits=3 is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "AWQ version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}}, "float weights other than FP8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}}}},
     "2-bit integer weights are not supported"),
    # malformed fields, named
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     r"config_groups.group_0.weights.group_size must be an integer, got None"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": None, "type": "int", "strategy": "channel"}}}},
     r"config_groups.group_0.weights.num_bits must be an integer, got None"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": ["Linear"]}},
     r"config_groups.group_0 must be an object, got list"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": "128 by 128"}}}},
     r"config_groups.group_0.weights.block_structure must be \[rows, columns\] of positive integers"),
    ({"quant_method": "fp8", "weight_block_size": ["128", "128"]},
     r"weight_block_size must be \[rows, columns\] of positive integers, got \['128', '128'\]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down_proj": {}}},
     r"GPTQModel's per-module overrides \(dynamic\) are not supported"),
])  # fmt: skip
def test_unknown_or_unsupported_schemes_are_refused_by_name(qc, message):
    with pytest.raises(ModelLoadError, match=message):
        formats.parse({"quantization_config": qc}, Path("config.json"))


def _int_quantized(symmetric: bool = True, strategy: str = "group") -> formats.QuantFormat:
    weights = {"num_bits": 8, "type": "int", "strategy": strategy, "symmetric": symmetric}
    weights |= {"group_size": 32} if strategy == "group" else {}
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}  # fmt: skip
    return formats.parse({"quantization_config": qc}, Path("config.json"))


@pytest.mark.parametrize("zero_shape", [(8, 2), (8, 1), (1,)])
def test_int_quantized_zero_points_per_group_row_or_tensor(zero_shape):
    """compressed-tensors' asymmetric int8 (W8A16 in groups or per row): the zero point per group, row or tensor."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randint(-128, 128, (8, 64), generator=gen, dtype=torch.int8)
    zero_point = torch.randint(-10, 10, zero_shape, generator=gen, dtype=torch.int8)
    groups = 2 if zero_shape == (8, 2) else 1
    fmt = _int_quantized(symmetric=False, strategy="group" if groups == 2 else "channel")
    scale = torch.rand(8, groups, generator=gen)
    tensors = {"m.weight": weight, "m.weight_scale": scale, "m.weight_zero_point": zero_point}
    read = fmt.read(tensors.get, "m", 8, 64, Path("model.safetensors"))
    zero = zero_point.float().reshape(-1, groups if zero_point.numel() > 1 else 1).expand(8, groups)
    want = (weight.float() - zero.repeat_interleave(64 // groups, 1)) * scale.repeat_interleave(64 // groups, 1)
    torch.testing.assert_close(read.dequantize(torch.float32), want)


def test_tensors_of_the_wrong_size_are_refused_by_name():
    where = Path("model.safetensors")
    weight = torch.zeros(8, 64, dtype=torch.int8)
    bad_zero = {"m.weight": weight, "m.weight_scale": torch.ones(8, 2), "m.weight_zero_point": torch.zeros(3)}
    with pytest.raises(ModelLoadError, match=r"'m.weight_zero_point' is float32, expected int8 or int32"):
        _int_quantized(symmetric=False).read(bad_zero.get, "m", 8, 64, where)
    bad_zero["m.weight_zero_point"] = torch.zeros(3, dtype=torch.int8)
    with pytest.raises(ModelLoadError, match=r"'m.weight_zero_point' has shape \(3,\), expected \(8, 2\)"):
        _int_quantized(symmetric=False).read(bad_zero.get, "m", 8, 64, where)
    channel_fp8 = {"num_bits": 8, "type": "float", "strategy": "channel"}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": channel_fp8}}}  # fmt: skip
    fp8 = formats.parse({"quantization_config": qc}, Path("config.json"))
    channel = {"m.weight": torch.zeros(8, 64, dtype=torch.float8_e4m3fn), "m.weight_scale": torch.ones(5, 1)}
    with pytest.raises(ModelLoadError, match=r"'m.weight_scale' has shape \(5,\), expected \(8,\)"):
        fp8.read(channel.get, "m", 8, 64, where)
    gptq = formats.parse({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}},
                         Path("config.json"))  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"m: its sizes \[100, 8\] must be multiples of 8"):
        gptq.read({}.get, "m", 8, 100, where)


def test_an_older_block_structure_string_reads_as_its_block():
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": "64x32"}}}}  # fmt: skip
    fmt = formats.parse({"quantization_config": qc}, Path("config.json"))
    assert fmt.weight_scheme("m", 128, 128).group_size == 32


@pytest.mark.parametrize("march", [None, "x86-64-v3", "x86-64"], ids=["this-cpu", "avx2", "plain-c"])
def test_the_native_kernels_of_every_instruction_set_equal_the_reference(march):
    """quant_w4a16.c and quant_w8a8.c built for this CPU, for AVX2 and for plain C (every path this machine can
    run): W4A16 (with zero points, 1 to 20 rows: row tiles of 8 and 4 and their remainders) and W8A8 (N and K padded
    in its packed layout, 1 to 84 rows, fp32 and bf16)."""
    from overlap.engine.model import native
    from overlap.engine.model.quant.kernels import nibbles, quantize_per_token

    if march is not None and march.endswith("v3") and native.cpu_isa() not in ("AVX2", "AVX-512", "AVX512-BF16",
                                                                                  "AMX-BF16"):  # fmt: skip
        pytest.skip("this CPU has no AVX2")
    kernel = native.quant_linear_kernel(march)
    if kernel is None:
        pytest.skip("no C compiler")
    assert kernel.isa == {None: kernel.isa, "x86-64-v3": "AVX2", "x86-64": "C"}[march]
    gen = torch.Generator().manual_seed(5)
    n, k, group = 72, 384, 128
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale, zero = torch.rand(n, k // group, generator=gen) * 0.01, torch.randint(0, 16, (n, k // group)).float()
    w4 = QuantizedWeight(codes, scale, zero, 4, group, "test").dequantize(torch.float32)
    w8 = torch.randint(-128, 128, (n, k + 40), generator=gen, dtype=torch.int8)  # N and K past a whole block
    w8_scale = torch.rand(n, generator=gen) * 0.01
    packed8 = kernel.w8a8_pack(w8)
    offset = scale * zero
    for rows in (1, 3, 8, 13, 20):
        x = torch.randn(rows, k, generator=gen)
        got = kernel.w4a16(x, nibbles(codes), scale, offset, group)
        torch.testing.assert_close(got, x @ w4.t(), atol=1e-4, rtol=1e-4)
        for bf16_group in (32, 64, 128):  # bf16 x: vdpbf16ps where the CPU has AVX512-BF16, else the fp32 path
            bias = 128.0 if kernel.bf16_path(k, bf16_group) else 0.0
            s, z = scale.repeat_interleave(group // bf16_group, 1), zero.repeat_interleave(group // bf16_group, 1)
            xb = x.bfloat16()
            got = kernel.w4a16(xb, nibbles(codes), s, s * (z + bias), bf16_group)
            torch.testing.assert_close(got, xb.float() @ w4.t(), atol=1e-3, rtol=1e-3)
            # the larger steps' tiles (AVX512-BF16 only): every row count, past 8 and 64 rows too, bf16 out
            for xt in (xb, torch.randn(rows + 64, k, generator=gen).bfloat16()):
                tiles = kernel.w4a16_tiles(xt, nibbles(codes), s, s * (z + 128.0), bf16_group)
                assert (tiles is None) == (not bias)
                if tiles is not None:
                    want = xt.float() @ w4.t()
                    torch.testing.assert_close(tiles.float(), want, atol=1e-3 * float(want.abs().max()), rtol=1e-2)
        for x8 in (torch.randn(rows, k + 40, generator=gen), torch.randn(rows + 64, k + 40, generator=gen)):
            x_q, x_scale = quantize_per_token(x8)  # past 8 rows: the inputs in chunks, the sums kept between them
            sums = (x_q.int() @ w8.int().t()).float() * w8_scale
            got = kernel.w8a8(x8, packed8, w8.sum(1, dtype=torch.int32), w8_scale)
            torch.testing.assert_close(got, sums * x_scale, atol=1e-5, rtol=1e-5)
            x_q, x_scale = quantize_per_token(x8.bfloat16().float())  # bf16 x read as it is, bf16 out rounded once
            sums = (x_q.int() @ w8.int().t()).float() * w8_scale
            got = kernel.w8a8(x8.bfloat16(), packed8, w8.sum(1, dtype=torch.int32), w8_scale, torch.bfloat16)
            assert torch.equal(got, (sums * x_scale).bfloat16())
        x8 = x8[:rows]
        # The larger steps' halves: x quantized as it comes (bf16 read without an fp32 copy), the sums scaled per row
        for x_in in (x8, x8.bfloat16()):
            codes8, scales8 = kernel.w8a8_quantize(x_in)
            want_q, want_scale = quantize_per_token(x_in.float())
            assert torch.equal(codes8.int() - 128, want_q.int()) and torch.equal(scales8, want_scale)
        sums = (x_q.int() @ w8.int().t()).float() * w8_scale
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(kernel.w8a8_scale_rows(sums, x_scale, dtype), (sums * x_scale).to(dtype))
    dense = kernel.w4a16_dequantize(nibbles(codes), scale, offset, 0.0, group, torch.bfloat16)
    torch.testing.assert_close(dense.float(), w4.bfloat16().float(), atol=1e-6, rtol=1e-2)
    dense = kernel.w4a16_dequantize(nibbles(codes), scale, scale * (zero + 128), 128.0, group, torch.float32)
    torch.testing.assert_close(dense, w4, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    ("bits", "group", "rows", "dtype"),
    [(4, 128, 3, torch.float32), (4, 32, 20, torch.float32), (8, 64, 5, torch.float32), (4, 128, 70, torch.bfloat16)],
)
def test_the_triton_kernel_equals_the_dequantized_weight_in_the_interpreter(monkeypatch, bits, group, rows, dtype):
    """The GPU path's W4A16 / W8A16 kernel (dequantized inside the matmul), in Triton's interpreter on the CPU."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from overlap.engine.model.quant.triton_kernels import TritonWeightOnly

    gen = torch.Generator().manual_seed(6)
    n, k = 80, 256
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01
    zero = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
    perm = torch.randperm(k, generator=gen) if group == 32 else None  # act-order: x read in the stored order
    weight = QuantizedWeight(codes, scale, zero, bits, group, "test", perm=perm)
    assert TritonWeightOnly.supports(weight)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    want = (x.float() @ weight.dequantize(dtype).float().t()).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(TritonWeightOnly(weight, dtype)(x), want, atol=tolerance, rtol=tolerance)


def _fp8_weight(n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    """Every finite FP8 byte (negative and subnormal ones too) at random, with a scale per row and group."""
    gen = torch.Generator().manual_seed(seed)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randint(0, len(finite), (n, k), generator=gen)]
    scale = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-3
    return QuantizedWeight(codes, scale, torch.zeros_like(scale), 8, group, "test fp8", float8=True)


@pytest.mark.parametrize(("group", "rows", "dtype"), [(128, 3, torch.float32), (256, 20, torch.float32),
                                                      (128, 70, torch.bfloat16)])  # fmt: skip
def test_the_triton_fp8_kernel_decodes_every_byte_as_torch_does(monkeypatch, group, rows, dtype):
    """FP8 weights with group or 128x128 block scales (a block's scale repeated per row), in the interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from overlap.engine.model.quant.triton_kernels import TritonWeightOnly

    weight = _fp8_weight(80, 256, group, seed=8)
    assert TritonWeightOnly.supports(weight)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    want = (x.float() @ weight.dequantize(torch.float32).t()).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(TritonWeightOnly(weight, dtype)(x), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_scaled_mm_fp8_equals_per_token_fp8_activations_over_the_dequantized_weight(rows):
    """The FP8 tensor-core path (per-row weight scales); torch runs `_scaled_mm` on a CPU too, slowly."""
    from overlap.engine.model.quant.kernels import ScaledMmFp8, quantize_fp8_per_token

    weight = _fp8_weight(64, 256, 256, seed=10)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(11)).bfloat16()
    x_fp8, x_scale = quantize_fp8_per_token(x)
    assert float(x_fp8.float().abs().max()) == 448.0  # each row's absmax lands on FP8's largest value
    want = (x_fp8.float() * x_scale) @ weight.dequantize(torch.float32).t()
    torch.testing.assert_close(ScaledMmFp8(weight, torch.bfloat16)(x).float(), want, atol=2e-2, rtol=1e-2)
    assert not ScaledMmFp8.supports(weight, torch.bfloat16)  # only on a CUDA card with FP8 (compute capability 8.9+)


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_the_int8_gemm_path_pads_the_rows_cublas_wants_and_equals_the_reference(rows):
    """W8A8 on CUDA goes through torch._int_mm, which takes more than 16 rows there: fewer are padded with zero
    rows (exercised here on the CPU, where torch runs the same op) and cut off again."""
    from overlap.engine.model.quant.kernels import Int8Dynamic

    gen = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 256, (64, 256), generator=gen, dtype=torch.uint8)
    weight = QuantizedWeight(codes, torch.rand(64, 1, generator=gen) * 0.01, torch.full((64, 1), 128.0), 8, 256,
                             "test", act_bits=8)  # fmt: skip
    assert Int8Dynamic.supports(weight)
    method = Int8Dynamic(weight, torch.float32)
    method.min_rows = 17  # as on CUDA
    x = torch.randn(rows, 256, generator=gen)
    want = Int8DynamicReference(weight, torch.float32)(x)
    torch.testing.assert_close(method(x), want, atol=1e-3 * float(want.abs().max()), rtol=1e-3)


@pytest.mark.parametrize(("pair", "kernel"), [(("llama", "W4A16"), "W4A16 Triton kernel"),
                                              (("qwen3", "FP8_DYNAMIC"), "FP8 (16-bit activations) Triton kernel")],
                         ids=["w4a16", "fp8"])  # fmt: skip
def test_the_device_paths_run_a_quantized_checkpoint_through_triton(compressed, monkeypatch, pair, kernel):
    """The runner's device paths (what CUDA takes), Triton in its interpreter: the projections go through the Triton
    kernel and the greedy tokens equal the CPU paths'."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    folder = compressed[pair]
    prompts = _prompts(17, count=2)
    device = ModelRunner(EngineConfig(num_kv_blocks=64, max_seq_len=256, attention_backend="triton"), folder,
                         cpu_paths=False)  # fmt: skip
    assert kernel in device.kernels
    try:
        got = greedy_tokens(device, prompts, 8, chunk=256)
    finally:
        device.close()
    cpu = _runner(folder)
    try:
        assert got == greedy_tokens(cpu, prompts, 8, chunk=256)
    finally:
        cpu.close()


def test_random_weights_of_a_quantized_shape_are_codes_of_its_scheme(tmp_path):
    """Benchmarks make a shape's weights on the device: a W4A16 config gives 4-bit codes, counted as such."""
    from overlap.engine.model.shapes import shape_config

    config = shape_config("qwen2.5-0.5b", "w4a16") | {"num_hidden_layers": 2, "vocab_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(EngineConfig(num_kv_blocks=16, max_seq_len=64, dtype="bfloat16"), tmp_path,
                         random_weights=True)  # fmt: skip
    try:
        assert "W4A16 native" in runner.kernels
        h, i = config["hidden_size"], config["intermediate_size"]
        per_layer = h * (h + 2 * 128) + h * h + 3 * h * i  # q|k|v, o, gate|up, down weights
        # every weight counted once as a weight (not as bytes / itemsize), the norms' few with them
        assert 0 <= runner.weight_params - (2 * per_layer + config["vocab_size"] * h) <= 5 * h
        assert runner.weight_bytes < 2 * per_layer * 0.6 + 2 * (config["vocab_size"] * h + h)
    finally:
        runner.close()


@pytest.mark.parametrize("scheme", ["fp8", "fp8-block"])
def test_a_shape_written_in_an_fp8_scheme_reads_back_as_the_random_weights_lay_it_out(tmp_path, scheme):
    """`overlap model build-shape --quantization fp8|fp8-block` writes what the loader reads as FP8 weights, and the
    benchmarks' random weights of the same config have the same layout (a scale per row and group of 128 columns)."""
    from overlap.engine.model import loader, model_spec, shapes

    config = shapes.shape_config("qwen2.5-0.5b", scheme) | {"num_hidden_layers": 1, "vocab_size": 1024}
    shapes._write_weights(tmp_path, config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_spec.read_spec(tmp_path)
    read = loader.load_weights(spec, tmp_path, torch.bfloat16, torch.device("cpu")).layers[0].gate_up
    made = loader.random_weights(spec, torch.bfloat16, torch.device("cpu")).layers[0].gate_up
    for weight in (read, made):
        assert weight.float8 and weight.shape == (2 * config["intermediate_size"], config["hidden_size"])
        assert weight.group_size == (128 if scheme == "fp8-block" else config["hidden_size"])
    assert 0.015 < float(read.dequantize(torch.float32).std()) < 0.025  # the spread of Normal(0, 0.02)
