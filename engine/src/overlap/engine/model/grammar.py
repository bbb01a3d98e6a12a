"""Structured outputs in the runner: one llguidance matcher per request with a grammar, masking its logits row.

The sidecar turns `response_format` / `guided_*` into an llguidance grammar string and checks it; the engine builds
the request's matcher when the request arrives (between steps, never inside a forward) and the runner masks the
request's row before sampling and advances the matcher with the sampled token. llguidance computes a mask lazily
(tens of microseconds per token for JSON schemas), so no compile step sits on the step's critical path.

The matcher follows the tokens by position: a step whose token the engine dropped (a preemption) is rolled back
before the position is sampled again.

Start-up costs stay off the serving path: the llguidance tokenizer is built by a background thread when the runner
starts, and the masks are unpacked with plain torch ops (llguidance.torch compiles its kernel with torch.compile
on first use, which took 1.6 s on a 2-core machine; `overlap bench sampling` measures the per-token cost).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch

from overlap.engine.errors import InvalidRequestError


class GrammarSet:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._model_dir, self._vocab_size, self._eos = model_dir, vocab_size, sorted(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._lock = threading.Lock()  # the tokenizer is built once, by whichever thread asks first
        self._matchers: dict[str, tuple[object, list[int]]] = {}  # request id -> (matcher, tokens it consumed)
        if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
            # transformers is imported here, before the thread: while the thread was still importing it, another
            # thread's `from transformers import AutoModelForCausalLM` found no such name (the tests and the GPU
            # check import it right after building an engine); about 0.3 s of start-up.
            import transformers  # noqa: F401

            threading.Thread(target=self._warm_up, name="overlap-grammar-warmup", daemon=True).start()

    def _warm_up(self) -> None:
        # Without llguidance or a usable tokenizer, the first grammar request says why.
        with contextlib.suppress(Exception):
            self._llg_tokenizer()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                try:
                    hf = AutoTokenizer.from_pretrained(str(self._model_dir))
                except Exception as exc:
                    raise InvalidRequestError(f"structured output needs the model's tokenizer: {exc}") from exc
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size, eos_token=self._eos)
                self._executor = llguidance.LLExecutor()  # computes a step's masks over its rows in parallel
            return self._tokenizer

    def add(self, request_id: str, grammar: str) -> None:
        """Build the request's matcher; a grammar llguidance rejects raises InvalidRequestError with its message."""
        import llguidance

        tokenizer = self._llg_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"invalid grammar: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid grammar: {matcher.get_error()}")
        self._matchers[request_id] = (matcher, [])

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, str, int]]) -> None:
        """In place: every (row, request id, tokens generated so far) row of `logits` keeps only what the request's
        grammar allows next."""
        vocab = self._llg_tokenizer().vocab_size
        words = (vocab + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # bit t of the row: token t is allowed
        matchers = []
        for n, (_, request_id, num_generated) in enumerate(rows):
            matcher, consumed = self._matchers[request_id]
            if len(consumed) > num_generated:  # tokens of a dropped step: take them back
                matcher.rollback(len(consumed) - num_generated)
                del consumed[num_generated:]
            matchers.append((matcher, n))
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> bits) & 1).bool().view(len(rows), -1)
        index = torch.tensor([row for row, _, _ in rows], device=logits.device)
        selected = logits.index_select(0, index)
        width = min(selected.shape[1], allowed.shape[1])
        selected[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
        selected[:, width:] = float("-inf")  # ids past the tokenizer's vocabulary are never allowed
        logits.index_copy_(0, index, selected)

    def advance(self, request_id: str, token: int) -> None:
        entry = self._matchers.get(request_id)
        if entry is not None and not entry[0].is_stopped():
            entry[0].consume_token(token)
            entry[1].append(token)
