"""The model runner against transformers: same logits, same greedy tokens, over paged KV in any block layout."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlap.engine.config import EngineConfig
from overlap.engine.errors import ModelLoadError
from overlap.engine.model.layers.linear import Linear
from overlap.engine.model.runner import ModelRunner
from overlap.engine.types import ModelInput, SamplingParams, ScheduledSeq

GREEDY = SamplingParams(temperature=0, max_tokens=64)


pytestmark = pytest.mark.usefixtures("two_torch_threads")


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(num_kv_blocks=128, max_seq_len=512), tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _prompts(n: int, seed: int = 0, vocab: int = 8192) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # ignore EOS, like the runner loop below
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _block_tables(lengths: list[int], block_size: int, num_blocks: int, fragmented: bool, seed: int = 0):
    """Disjoint block tables: consecutive runs, or shuffled ids (every table a scatter of blocks)."""
    ids = list(range(num_blocks))
    if fragmented:
        random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for length in lengths:
        need = -(-length // block_size)
        tables.append(ids[at : at + need])
        at += need
    assert at <= num_blocks, "test asks for more blocks than the pool holds"
    return tables


def _greedy_loop(runner, prompts, max_new_tokens, *, fragmented=False, chunk=None, sampling=GREEDY):
    """A minimal scheduler: prefill every prompt (in chunks of `chunk` tokens if set) in one batch, then decode all
    sequences together, `max_new_tokens` tokens each (EOS ignored)."""
    tables = _block_tables(
        [len(p) + max_new_tokens for p in prompts], runner.block_size, runner.num_kv_blocks, fragmented
    )
    done = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):  # (chunked) prefill steps
        seqs = []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                n = len(p) - done[i] if chunk is None else min(chunk, len(p) - done[i])
                last = done[i] + n == len(p)
                seqs.append(ScheduledSeq(f"r{i}", p[done[i] : done[i] + n], done[i], tables[i], last, sampling, 0))
                done[i] += n
        sampled = runner.execute(ModelInput(seqs)).token_ids
        for seq, token in zip([s for s in seqs if s.do_sample], sampled, strict=True):
            outputs[int(seq.request_id[1:])].append(token)
    for step in range(1, max_new_tokens):
        seqs = [
            ScheduledSeq(f"r{i}", [out[-1]], len(p) + step - 1, tables[i], True, sampling, step)
            for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))
        ]
        for out, token in zip(outputs, runner.execute(ModelInput(seqs)).token_ids, strict=True):
            out.append(token)
    return outputs


# ---- numerics against transformers --------------------------------------------------------------------------
def test_prefill_logits_match_transformers(runner, hf_model):
    prompt = _prompts(1, seed=3)[0]
    logits = runner.compute_logits(ModelInput([ScheduledSeq("a", prompt, 0, [5, 6, 7], True, GREEDY)]))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_packed_batch_logits_match_transformers(runner, hf_model):
    prompts = _prompts(5, seed=4)
    tables = _block_tables([len(p) for p in prompts], runner.block_size, runner.num_kv_blocks, fragmented=True)
    seqs = [ScheduledSeq(f"r{i}", p, 0, t, True, GREEDY) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    logits = runner.compute_logits(ModelInput(seqs))
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], hf_model(torch.tensor([p])).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_greedy_single_request_equals_transformers_generate(runner, hf_model):
    prompt = _prompts(1, seed=5)[0]
    assert _greedy_loop(runner, [prompt], 24)[0] == _hf_greedy(hf_model, prompt, 24)


@pytest.mark.parametrize(("fragmented", "chunk"), [(False, None), (True, None), (True, 7)])
def test_greedy_mixed_length_batch_equals_transformers_generate(runner, hf_model, fragmented, chunk):
    prompts = _prompts(10, seed=6)  # >= 8 decodes: the helper thread takes half of them
    got = _greedy_loop(runner, prompts, 12, fragmented=fragmented, chunk=chunk)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == _hf_greedy(hf_model, prompt, 12)


def test_greedy_output_is_not_degenerate(runner):
    tokens = _greedy_loop(runner, [[1, 200, 300]], 32)[0]
    assert len(set(tokens)) > 8


# ---- other Llama-family configs --------------------------------------------------------------------------------
def _save_random(tmp_path: Path, kind: str) -> Path:
    from transformers import (
        AutoModelForCausalLM,
        MistralConfig,
        Qwen2Config,
    )

    common = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=256,
        eos_token_id=2,
    )
    if kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1_000_000.0)
    else:
        config = MistralConfig(**common, sliding_window=4096, head_dim=48)  # head_dim != hidden / heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)  # transformers zero-inits biases; make Qwen2's q/k/v biases count
    folder = tmp_path / kind
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_llama_family_configs_match_transformers(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    folder = _save_random(tmp_path, kind)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(num_kv_blocks=64, max_seq_len=128), folder)
    prompts = _prompts(3, seed=7, vocab=512)
    seqs = [ScheduledSeq(f"r{i}", p, 0, [i * 8 + b for b in range(8)], True, GREEDY) for i, p in enumerate(prompts)]
    logits = runner.compute_logits(ModelInput(seqs))
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], hf(torch.tensor([p])).logits[0, -1], atol=1e-4, rtol=1e-4)
    for prompt, tokens in zip(prompts, _greedy_loop(runner, prompts, 8, fragmented=True), strict=True):
        assert tokens == _hf_greedy(hf, prompt, 8)


def test_bfloat16_runs_and_agrees_with_transformers_bf16(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(EngineConfig(dtype="bfloat16", num_kv_blocks=32, max_seq_len=256), tiny_model_dir)
    assert runner.k_pool.dtype == torch.bfloat16
    prompt = _prompts(1, seed=8)[0]
    logits = runner.compute_logits(ModelInput([ScheduledSeq("a", prompt, 0, [0, 1, 2], True, GREEDY)]))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0, -1].float()
    # bf16 keeps ~3 significant digits; the logits span about +-20.
    assert (logits[0] - expected).abs().max() < 0.5
    assert logits[0].argmax() == expected.argmax()


# ---- bad model folders -----------------------------------------------------------------------------------------
def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_folder_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelRunner(EngineConfig(), tmp_path / "nope")


def test_folder_without_config_raises(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        ModelRunner(EngineConfig(), tmp_path)


def test_unsupported_architecture_raises(tmp_path, tiny_model_dir):
    folder = _copy_model(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        ModelRunner(EngineConfig(), folder)


def test_missing_weights_raise(tmp_path, tiny_model_dir):
    folder = _copy_model(tiny_model_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        ModelRunner(EngineConfig(), folder)


def test_missing_tensor_raises(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    folder = _copy_model(tiny_model_dir, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*missing"):
        ModelRunner(EngineConfig(), folder)


def test_corrupt_config_raises(tmp_path, tiny_model_dir):
    folder = _copy_model(tiny_model_dir, tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelRunner(EngineConfig(), folder)


# ---- KV pool sizing ------------------------------------------------------------------------------------------
def test_kv_pool_is_sized_once_from_config(runner, tiny_model_dir):
    assert runner.num_kv_blocks == 128
    assert runner.k_pool.shape == (6, 128 * 16, 8, 64)
    default = ModelRunner(EngineConfig(max_num_seqs=4, max_seq_len=256), tiny_model_dir)
    assert default.num_kv_blocks == 4 * 256 // 16  # CPU default: max_num_seqs full-length sequences
    assert default.eos_token_ids == (2,)
    assert default.max_model_len == 256


# ---- sampling ---------------------------------------------------------------------------------------------------
def _sample_once(runner, sampling: SamplingParams, num_generated: int = 0, prompt=(1, 40, 50, 60)) -> int:
    seq = ScheduledSeq("s", list(prompt), 0, [10], True, sampling, num_generated)
    return runner.execute(ModelInput([seq])).token_ids[0]


def _positions_batch(sampling: SamplingParams, num: int, prompt=(1, 40, 50, 60)) -> ModelInput:
    """`num` copies of one prompt, as if at generation steps 0..num-1 (same logits, different seeded draws)."""
    return ModelInput([ScheduledSeq(f"s{n}", list(prompt), 0, [n], True, sampling, n) for n in range(num)])


def test_seeded_sampling_is_reproducible(runner):
    first = runner.execute(_positions_batch(SamplingParams(temperature=5.0, seed=42), 12)).token_ids
    again = runner.execute(_positions_batch(SamplingParams(temperature=5.0, seed=42), 12)).token_ids
    assert first == again
    assert len(set(first)) > 1  # a hot temperature draws different tokens at different positions
    other = runner.execute(_positions_batch(SamplingParams(temperature=5.0, seed=43), 12)).token_ids
    assert other != first


def test_top_k_and_top_p_are_respected(runner):
    from overlap.engine.model import sampler

    prompt = [1, 40, 50, 60]
    logits = runner.compute_logits(ModelInput([ScheduledSeq("s", prompt, 0, [10], True, GREEDY)]))[0]
    rows = logits.expand(60, -1)
    gen = torch.Generator().manual_seed(0)

    def draw(**kw) -> set[int]:
        params = [SamplingParams(seed=s, **kw) for s in range(60)]
        return set(sampler.sample(rows, params, [0] * 60, gen)[0].tolist())

    top5 = set(logits.topk(5).indices.tolist())
    drawn = draw(temperature=50.0, top_k=5)
    assert drawn <= top5 and len(drawn) >= 3
    probs = (logits / 50.0).softmax(-1)
    order = probs.argsort(descending=True)
    nucleus_size = int((probs[order].cumsum(0) < 0.3).sum()) + 1
    drawn = draw(temperature=50.0, top_p=0.3)
    assert drawn <= set(order[:nucleus_size].tolist()) and len(drawn) >= 2
    both = draw(temperature=50.0, top_k=5, top_p=0.3)
    assert both <= top5 and both <= set(order[:nucleus_size].tolist())
    assert draw(temperature=0.0) == {int(logits.argmax())}
    assert draw(temperature=3.0, top_k=1) == {int(logits.argmax())}
    assert len(draw(temperature=50.0)) > 10  # no top-k/top-p: the whole vocabulary is in play


def test_mixed_batch_samples_each_row_by_its_own_params(runner):
    prompt = [1, 40, 50, 60]
    params = [GREEDY, SamplingParams(temperature=50.0, seed=7), SamplingParams(temperature=50.0, top_k=3, seed=7)]
    seqs = [ScheduledSeq(f"s{i}", prompt, 0, [20 + i], True, p) for i, p in enumerate(params)]
    tokens = runner.execute(ModelInput(seqs)).token_ids
    alone = [runner.execute(ModelInput([seq])).token_ids[0] for seq in seqs]
    assert tokens == alone  # same seed, same position: the same token alone or batched
    assert tokens[0] == int(runner.compute_logits(ModelInput(seqs[:1]))[0].argmax())


def test_step_without_sampling_returns_no_tokens(runner):
    seq = ScheduledSeq("a", [1, 2, 3], 0, [30], False, GREEDY)
    assert runner.execute(ModelInput([seq])).token_ids == []


def test_last_layer_runs_only_the_sampled_rows(runner, hf_model, monkeypatch):
    """Past its K/V writes the last layer feeds only the logits: a prompt chunk's other rows skip it, and the
    sampled row's logits are still transformers' own."""
    prompt, chunk = _prompts(1, seed=3)[0] + [7] * 20, [11] * 12  # 20+ tokens, sampled; 12, a non-final chunk
    seqs = [
        ScheduledSeq("a", prompt, 0, [40, 41, 42, 43], True, GREEDY),
        ScheduledSeq("b", chunk, 0, [50], False, GREEDY),
    ]
    rows: list[int] = []
    monkeypatch.setattr(runner.packer, "halves_min_tokens", None)  # one forward, so one sequence of calls
    for name in ("__call__", "silu"):  # every projection, through oneDNN or the native rows kernel
        original = getattr(Linear, name)
        monkeypatch.setattr(Linear, name, lambda self, x, fn=original: rows.append(x.shape[0]) or fn(self, x))
    logits = runner.compute_logits(ModelInput(seqs))
    total = len(prompt) + len(chunk)
    last_full = max(i for i, n in enumerate(rows) if n == total)  # the last layer's qkv projection
    after = rows[last_full + 1 :]  # o, the MLP (2 or 3 calls), lm_head: one row each
    assert len(after) >= 4 and set(after) == {1}, rows
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)


def test_block_table_outside_the_pool_is_refused(runner):
    seq = ScheduledSeq("a", [1, 2, 3], 0, [runner.num_kv_blocks], True, GREEDY)
    with pytest.raises(ValueError, match="outside the pool"):
        runner.execute(ModelInput([seq]))
    short = ScheduledSeq("b", list(range(3, 40)), 0, [1], True, GREEDY)  # 37 tokens need 3 blocks
    with pytest.raises(ValueError, match="block table covers"):
        runner.execute(ModelInput([short]))


LOADED_MAPS = """
import sys
from pathlib import Path
from overlap.engine.config import EngineConfig
from overlap.engine.model.runner import ModelRunner
runner = ModelRunner(EngineConfig(num_kv_blocks=16, max_seq_len=64), sys.argv[1])
print(sum(sys.argv[1] in line for line in Path("/proc/self/maps").read_text().splitlines()))
"""


def test_the_loaded_runner_keeps_no_view_of_the_checkpoint_file(tiny_model_dir: Path):
    """The weights are read through the file's mapping; a tensor kept as it was read would keep the whole file
    mapped, and its pages resident beside the layers' own copies. In a process of its own: another test's runner on
    the device-generic paths (F.linear on the checkpoint's tensors) may keep it mapped on purpose."""
    folder = str(tiny_model_dir.resolve())
    out = subprocess.run([sys.executable, "-c", LOADED_MAPS, folder], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "0"
