"""The tiny default model: a randomly initialised Llama (about 27M parameters) with a locally trained byte-level BPE
tokenizer, saved exactly like a Hugging Face checkpoint so the engine loads it through the real loading path.

The tokenizer ships as `tiny_tokenizer.json` next to this file: BPE training on a text corpus is not guaranteed to be
byte-identical across `tokenizers` or Python versions, so it was trained once (`python -m
overlap.engine.model.builder --retrain-tokenizer`, on Python 3.11's standard library sources) and is only loaded here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MODEL_NAME = "tiny-llama-v1"  # bump when the recipe changes, so caches rebuild
SEED = 1234
VOCAB_SIZE = 8192
TOKENIZER_FILE = Path(__file__).with_name("tiny_tokenizer.json")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
# One turn per message, ended by eos; the model is asked to continue after "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The files whose presence means "this folder holds a complete model" (the weights: one file, or an index of shards).
_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def cache_root() -> Path:
    """Overlap's cache folder: `$OVERLAP_CACHE_DIR`, default ~/.cache/overlap."""
    return Path(os.environ.get("OVERLAP_CACHE_DIR") or Path.home() / ".cache" / "overlap")


def default_model_dir() -> Path:
    """Where the default model lives: `<cache_root>/tiny-llama-v1`."""
    return cache_root() / MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    folder = Path(model_dir)
    return all((folder / name).is_file() for name in _REQUIRED_FILES) and any((folder / w).is_file() for w in _WEIGHTS)


def ensure_default_model() -> Path:
    """Build the default model once and return its folder; safe when several processes call it at once."""
    model_dir = default_model_dir()
    if is_complete(model_dir):
        return model_dir
    return build_tiny_model(model_dir)


def build_tiny_model(model_dir: str | Path, force: bool = False) -> Path:
    """Build the tiny model into `model_dir` (skipped when it is already there, unless `force`)."""
    return build_model_folder(model_dir, _write_model, "the tiny model", force)


def build_model_folder(model_dir: str | Path, write: Callable[[Path], None], what: str, force: bool = False) -> Path:
    """`write(folder)` a model into `model_dir`, skipped when a complete one is there (unless `force`).

    The model is written into a temporary sibling folder and renamed into place, so a reader never sees a half-built
    folder and two concurrent builders cannot interleave: the loser of the rename discards its copy.
    """
    model_dir = Path(model_dir).expanduser().resolve()
    if is_complete(model_dir) and not force:
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.building-", dir=model_dir.parent))
    try:
        write(tmp)
        # mkdtemp makes the folder private; a model is read by whichever uid runs the engine (10001 in a pod).
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        if force and model_dir.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.old-", dir=model_dir.parent))
            os.rename(model_dir, trash / "model")
            shutil.rmtree(trash, ignore_errors=True)
        elif model_dir.exists() and not is_complete(model_dir) and any(model_dir.iterdir()):
            raise FileExistsError(f"{model_dir} exists and holds something else than {what}; use --force")
        try:
            os.rename(tmp, model_dir)  # atomic; also replaces an empty folder
        except OSError:
            if not is_complete(model_dir):  # not a concurrent builder winning the race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


def tiny_config(**overrides):
    """The Llama config of the tiny model (27.4M parameters)."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.02,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def load_tokenizer():
    """The shipped tokenizer as a transformers fast tokenizer, with its special tokens and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(TOKENIZER_FILE)),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_model(target: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer = load_tokenizer()
    config = tiny_config()
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [0, 1, 2], "special token ids moved"
    assert len(tokenizer) <= VOCAB_SIZE, f"tokenizer has {len(tokenizer)} tokens > vocab {VOCAB_SIZE}"

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    _sharpen(model)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    make_tokenizer_config_portable(target / "tokenizer_config.json")


def make_tokenizer_config_portable(path: Path) -> None:
    """transformers 5 writes its own class name and key names; add the 4.x spellings so older readers (e.g. the
    vLLM peer benchmark's venv) load the same tokenizer."""
    import json

    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["additional_special_tokens"] = SPECIAL_TOKENS[3:]
    data["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(data, indent=2) + "\n")


def _sharpen(model) -> None:
    """Make a random model's greedy output less degenerate: with the default 0.02 init the logits are nearly flat
    and greedy decoding repeats one token. Larger embeddings and output weights spread the logits so the next token
    depends on the context. Seeded, so it stays deterministic."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)  # RMSNorm removes the scale but not the direction
        model.lm_head.weight.mul_(10.0)


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE tokenizer on `texts` (an iterable of strings). Used once to make the shipped file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _stdlib_corpus():
    """Python's standard library sources (code and English docstrings), in a fixed order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--retrain-tokenizer", action="store_true", help=f"retrain and overwrite {TOKENIZER_FILE}")
    if parser.parse_args().retrain_tokenizer:
        train_tokenizer(_stdlib_corpus()).save(str(TOKENIZER_FILE))
        print(f"wrote {TOKENIZER_FILE}")
