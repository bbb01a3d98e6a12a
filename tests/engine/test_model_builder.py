"""The tiny default model: built deterministically, loadable by transformers, built once under concurrency."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap.engine.model import builder


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_default_model_is_a_loadable_llama(tiny_model_dir: Path):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (512, 6, 8)
    assert config.vocab_size == 8192
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    ids = tokenizer("Hello world, this is Overlap.")["input_ids"]
    assert tokenizer.decode(ids) == "Hello world, this is Overlap."
    assert max(ids) < config.vocab_size
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_parameter_count_is_about_27m(tiny_model_dir: Path):
    from safetensors import safe_open

    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        total = sum(_prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    assert 26_000_000 < total < 29_000_000


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_build_is_deterministic_and_skips_existing(tmp_path: Path, tiny_model_dir: Path):
    target = builder.build_tiny_model(tmp_path / "m")
    assert _digest(target) == _digest(tiny_model_dir)
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert builder.build_tiny_model(target) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    builder.build_tiny_model(target, force=True)
    assert _digest(target) == _digest(tiny_model_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folders left behind


def test_refuses_to_overwrite_a_foreign_folder(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        builder.build_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_concurrent_ensure_builds_one_complete_model(tmp_path: Path):
    env = {**os.environ, "OVERLAP_CACHE_DIR": str(tmp_path)}
    code = "from overlap.engine.model.builder import ensure_default_model; print(ensure_default_model())"
    children = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [child.communicate(timeout=120)[0].strip() for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert len(set(results)) == 1
    built = Path(results[0])
    assert builder.is_complete(built)
    assert [p.name for p in tmp_path.iterdir()] == [builder.MODEL_NAME]
