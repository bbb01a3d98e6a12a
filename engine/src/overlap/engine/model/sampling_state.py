"""The runner's per-request sampling state: each request's sampled tokens on the device (for penalties and bad words)
and its structured-output grammar, applied to a step's logits before `sampler.sample` picks the tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from overlap.engine.model import sampler
from overlap.engine.model.grammar import GrammarSet
from overlap.engine.model.staging import to_device
from overlap.engine.model.step_inputs import StepInputs


class SamplingState:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device,
                 seed: int, argmax=None) -> None:  # fmt: skip
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.argmax = argmax  # the native greedy argmax on CPU, else torch's
        self._histories: dict[str, list[torch.Tensor]] = {}  # request id -> its sampled tokens
        self._grammars = GrammarSet(model_dir, vocab_size, eos_token_ids)

    def sample(self, logits: torch.Tensor, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [S] and their rows' finiteness (`sampler.sample`) from the raw logits: the logits controls
        first (penalties, bias, grammars ...), for the rows that set any."""
        if any(p.has_logits_controls for p in inputs.sampling):
            rows = list(zip(inputs.request_ids, inputs.num_generated, inputs.sampling, strict=True))
            drafts = inputs.row_drafts or [()] * len(rows)  # proposals before a row count as generated there
            histories = [self._history_of(rid, n - len(d), d) if p.needs_history else None
                         for (rid, n, p), d in zip(rows, drafts, strict=True)]  # fmt: skip
            logits = sampler.apply_logits_controls(logits, inputs.sampling, inputs.num_generated, histories,
                                                   inputs.prompts, self.eos_token_ids)  # fmt: skip
            grammar_rows = [(row, rid, n) for row, (rid, n, p) in enumerate(rows) if p.grammar is not None]
            if grammar_rows:  # structured outputs: what the grammar does not allow next gets -inf
                self._grammars.mask(logits, grammar_rows)
        return sampler.sample(logits, inputs.sampling, inputs.num_generated, self.generator, self.argmax)

    def record(self, inputs: StepInputs, tokens: torch.Tensor) -> None:
        """Keep the tokens of requests whose controls need their history, on the device (no host sync). Indexed by
        position: a step whose tokens the engine dropped (a preemption, proposals past the accepted ones: a
        sequence's rows sample consecutive positions) is overwritten when the position is sampled again."""
        host_tokens = None
        for row, (rid, n, p) in enumerate(zip(inputs.request_ids, inputs.num_generated, inputs.sampling, strict=True)):
            if p.needs_history:
                history = self._histories.setdefault(rid, [])
                del history[n:]
                history.append(tokens[row : row + 1])
            if p.grammar is not None:  # the matcher runs on the host: this reads the step's tokens back
                host_tokens = tokens.tolist() if host_tokens is None else host_tokens
                self._grammars.advance(rid, host_tokens[row])

    def _history_of(self, request_id: str, num_generated: int, drafts=()) -> torch.Tensor:
        history = self._histories.get(request_id, [])[:num_generated]
        if drafts:
            history = [*history, *to_device(self.device, list(drafts))]
        if not history:
            return torch.empty(0, dtype=torch.long, device=self.device)
        return torch.cat(history).to(torch.long)

    def add_grammar(self, request_id: str, grammar: str) -> None:
        """Build a request's grammar matcher before it is scheduled; InvalidRequestError for a bad grammar."""
        self._grammars.add(request_id, grammar)

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
        self._grammars.forget(request_id)
