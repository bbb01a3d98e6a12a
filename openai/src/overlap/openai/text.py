"""A model's text as the sidecar and the router both see it: prompts and chat messages (through the model's chat
template) tokenized the same way in both, so the router hashes the tokens the replica will cache. The sidecar's
incremental detokenizer is `overlap.sidecar.detokenize`."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path


def tokenizer_folder(files: dict[str, bytes]) -> str:
    """Tokenizer files (name -> content) written once into a cache folder named by their content."""
    digest = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(files.items()))).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"overlap-tokenizer-{digest[:16]}"
    if not folder.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        for name, data in files.items():
            (staging / Path(name).name).write_bytes(data)
        try:
            staging.rename(folder)
        except OSError:  # another process won the race: same content
            shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


class TextProcessor:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.backend = self.tokenizer.backend_tokenizer  # the Rust tokenizer: fast encode and streaming decode
        self.model_dir = str(model_dir)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self._token_texts: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The chat template renders the special tokens itself, so by default they are not added again. `tools`
        go to the template, which shows them to the model in its own format."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token on its own, as logprobs name it (vLLM: the token decoded alone, special tokens kept)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text
