"""Generated ids to text in the sidecar: detokenized incrementally (a character split across tokens is held back
until complete), with `stop` strings matched on the detokenized text."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from overlap.openai.text import TextProcessor

_PROMPT_CONTEXT_TOKENS = 6  # prompt ids fed to the decoder first, so the first generated token gets its spacing right


class IncrementalDetokenizer:
    """Turns generated ids into text deltas. With stop strings, the last `max(len(stop)) - 1` characters are held
    back (they might begin a stop string); when one matches, the text is cut before it and `stopped` is set. Stop
    strings are checked after every token, as vLLM does, so the result does not depend on how many tokens arrive
    at once (a speculative step delivers several); `tokens_kept` says how many of the last push's ids were
    consumed, up to the one that completed the stop string."""

    def __init__(self, text: TextProcessor, prompt_token_ids: list[int], stop: list[str]) -> None:
        self._backend = text.backend
        self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded and not shown yet: the held-back tail and this push's pieces
        self.stopped = False
        self.tokens_kept = 0

    def push(self, token_ids: list[int]) -> str:
        """Feed new ids; return the text that is now safe to show (maybe "")."""
        if self.stopped:
            self.tokens_kept = 0
            return ""
        self.tokens_kept = len(token_ids)
        for n, token_id in enumerate(token_ids, 1):
            piece = self._step(token_id)
            if not piece:
                continue
            # a stop string this piece completes starts at or after here: what came before it was shown already
            search_from = max(0, len(self._pending) - self._holdback)
            self._pending += piece
            if self._stop:
                cut = min((i for s in self._stop if (i := self._pending.find(s, search_from)) != -1), default=-1)
                if cut != -1:
                    self._pending = self._pending[:cut]
                    self.stopped = True
                    self.tokens_kept = n
                    return self._take(len(self._pending))
        return self._take(len(self._pending) - self._holdback)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers' "Invalid prefix encountered" on some ids: start a fresh stream, as vLLM does
            self._stream = DecodeStream(skip_special_tokens=True)
            return self._stream.step(self._backend, token_id)

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        return self._take(len(self._pending))

    def _take(self, end: int) -> str:
        """The first `end` pending characters, now shown (the text is kept only until shown: appending to all of it
        would copy it whole at every token)."""
        if end <= 0:
            return ""
        delta, self._pending = self._pending[:end], self._pending[end:]
        return delta
