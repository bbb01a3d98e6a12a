"""Text in the sidecar: tokenize prompts and chat messages, detokenize generated ids incrementally (a character
split across tokens is held back until complete) and match `stop` strings on the detokenized text."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT_TOKENS = 6  # prompt ids fed to the decoder first, so the first generated token gets its spacing right


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

    def detokenizer(self, prompt_token_ids: list[int], stop: list[str]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], stop)


class IncrementalDetokenizer:
    """Turns generated ids into text deltas. With stop strings, the last `max(len(stop)) - 1` characters are held
    back (they might begin a stop string); when one matches, the text is cut before it and `stopped` is set. Stop
    strings are checked after every token, as vLLM does, so the result does not depend on how many tokens arrive
    at once (a speculative step delivers several); `tokens_kept` says how many of the last push's ids were
    consumed, up to the one that completed the stop string."""

    def __init__(self, backend, prompt_tail: list[int], stop: list[str]) -> None:
        self._backend = backend
        self._stream = DecodeStream(ids=list(prompt_tail), skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # everything decoded so far (cut at a stop string once matched)
        self._emitted = 0
        self.stopped = False
        self.tokens_kept = 0

    def push(self, token_ids: list[int]) -> str:
        """Feed new ids; return the text that is now safe to show (maybe "")."""
        if self.stopped:
            self.tokens_kept = 0
            return ""
        self.tokens_kept = len(token_ids)
        for n, token_id in enumerate(token_ids, 1):
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self._holdback)  # a stop string this piece completes starts here
            self.text += piece
            if self._stop:
                cut = min((i for s in self._stop if (i := self.text.find(s, search_from)) != -1), default=-1)
                if cut != -1:
                    self.text = self.text[:cut]
                    self.stopped = True
                    self.tokens_kept = n
                    return self._take(len(self.text))
        return self._take(len(self.text) - self._holdback)

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
