"""Speculative decoding's `draft_model` proposer: a smaller model with the target's vocabulary proposes its greedy
continuation, run in the engine process on its own KV pool.

The draft is a second ModelRunner (one rank, one whole-batch forward) over the draft folder. Its pool has as many
blocks as the target's, handed out from a free list of its own, so every sequence the target holds can have its
draft K/V too. Per request it keeps the ids whose K/V its pool holds (`_DraftSeq.tokens`): a proposal first rolls
that back to the longest prefix the request's tokens still share (what the target rejected, the draft drops too;
the blocks past it go back to the free list), then feeds the rest of the known tokens as one chunk and its own
greedy tokens one at a time, k forwards for k proposals. It runs on the engine thread, in the scheduler, for every
sequence likely to propose in a step at once (`prepare`): each forward is one batch of them (docs/engine.md,
"Speculative decoding").

Its proposals are a deterministic function of the tokens, a one-hot draft distribution, so the target's
verification (`types.accept_proposals`) stays rejection sampling and the output keeps the target's distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from overlap.engine.batching.speculative import Proposer
from overlap.engine.config import EngineConfig
from overlap.engine.errors import ConfigError
from overlap.engine.requests.request import Request
from overlap.engine.types import NONFINITE_TOKEN, ModelInput, SamplingParams, ScheduledSeq

_GREEDY = SamplingParams(temperature=0)


def _draft_sampling(sampling: SamplingParams) -> SamplingParams:
    """Greedy, with the request's logit_bias (a fixed shift of its logits, which can decide the target's token); the
    penalties and bad words depend on the output history, which the draft runner does not keep, so it leaves them
    (and the rest) to the target."""
    return _GREEDY if not sampling.logit_bias else SamplingParams(temperature=0, logit_bias=sampling.logit_bias)


@dataclass(slots=True)
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # the ids whose K/V the draft pool holds, positions 0..
    blocks: list[int] = field(default_factory=list)  # its block table in the draft pool


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, target, runner_class) -> None:
        """`target`: the engine's runner (it owns the draft), whose vocabulary the draft must share and whose pool
        size it takes; `runner_class`: ModelRunner, which runs the draft too."""
        spec = config.speculative
        self.k = spec.num_speculative_tokens
        draft_dir = Path(spec.model).expanduser()
        if not (draft_dir / "config.json").is_file():
            raise ConfigError(f"speculative_config: the draft model folder {spec.model!r} has no config.json")
        check_same_vocabulary(draft_dir, target.model_dir, target.vocab_size)
        draft_config = config.replace(model=str(draft_dir), speculative_config=None, tensor_parallel_size=1,
                                      quantization=None, num_kv_blocks=target.num_kv_blocks, cpu_step_plan="whole",
                                      cuda_graphs=False)  # fmt: skip
        self.runner = runner_class(draft_config, draft_dir)
        if self.runner.kv_split is not None:  # its sliding layers' pool wants window block tables, which drafts lack
            self.runner.close()
            raise ConfigError(f"speculative_config: the draft model {spec.model!r} mixes sliding-window and full "
                              "layers (Gemma 2/3, gpt-oss), which a draft model does not support yet; use a draft "
                              "of full layers or prompt_lookup")  # fmt: skip
        self.block_size = self.runner.block_size
        self._free = list(range(self.runner.num_kv_blocks - 1, -1, -1))  # pop() takes the lowest id
        self._seqs: dict[str, _DraftSeq] = {}
        self._ready: dict[str, tuple[int, list[int]]] = {}  # request id -> (its length, proposals) from prepare

    def prepare(self, wanted: list[tuple[Request, int]]) -> None:
        """Propose for all of `wanted` ((request, k) pairs) at once: one forward over every sequence's unseen tokens,
        then k - 1 over their latest proposals, each a batch of the sequences still short of their k. The proposals
        wait in `_ready` for `propose`, keyed by the request's length (its tokens only grow, so a length still
        current means the same tokens)."""
        feeds: dict[str, list[int]] = {}  # request id -> what its next draft forward feeds
        ks: dict[str, int] = {}
        samplings = {request.request_id: _draft_sampling(request.sampling) for request, _ in wanted}
        for request, k in wanted:
            tokens = request.all_token_ids
            k = min(k, self.k, self.runner.max_model_len - len(tokens) + 1)  # it writes up to position len + k - 2
            if k < 1:
                continue
            rid = request.request_id
            seq = self._seqs.setdefault(rid, _DraftSeq())
            seq.tokens = tokens[: _common_prefix(seq.tokens, tokens, len(tokens) - 1)]  # roll back what was rejected
            if self._fit(seq, len(tokens) + k - 1):  # else the draft pool is full: it decodes plainly
                feeds[rid], ks[rid] = tokens[len(seq.tokens) :], k
                self._ready[rid] = (len(tokens), [])
        while feeds:
            batch = [ScheduledSeq(request_id=rid, token_ids=feed, start_pos=len(self._seqs[rid].tokens),
                                  block_table=self._seqs[rid].blocks, do_sample=True, sampling=samplings[rid])
                     for rid, feed in feeds.items()]  # fmt: skip
            batch.sort(key=lambda seq: len(seq.token_ids) == 1)  # the runner takes prompt chunks first, then decodes
            sampled = self.runner.execute(ModelInput(seqs=batch)).token_ids
            feeds = {}
            for step, token in zip(batch, sampled, strict=True):
                rid = step.request_id
                self._seqs[rid].tokens += step.token_ids
                drafts = self._ready[rid][1]
                if token != NONFINITE_TOKEN:
                    drafts.append(token)
                    if len(drafts) < ks[rid]:
                        feeds[rid] = [token]

    def propose(self, request: Request, k: int) -> list[int]:
        length, drafts = self._ready.pop(request.request_id, (None, None))
        if length != request.num_tokens:  # not foreseen by prepare (or stale): this one alone
            self.prepare([(request, k)])
            length, drafts = self._ready.pop(request.request_id, (None, []))
        return drafts[:k]

    def probe(self, request: Request) -> bool:
        return True  # the draft always has something to propose; back-off and k follow its acceptance

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._ready.pop(request_id, None)
            seq = self._seqs.pop(request_id, None)
            if seq is not None:
                self._free.extend(reversed(seq.blocks))
                self.runner.forget_request(request_id)

    def _fit(self, seq: _DraftSeq, num_positions: int) -> bool:
        """Give `seq` the blocks for `num_positions` positions and return the rest; False when the pool is short."""
        need = -(-num_positions // self.block_size)
        while len(seq.blocks) > need:
            self._free.append(seq.blocks.pop())
        if need - len(seq.blocks) > len(self._free):
            return False
        while len(seq.blocks) < need:
            seq.blocks.append(self._free.pop())
        return True

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def close(self) -> None:
        self.runner.close()


def check_same_vocabulary(draft_dir: Path, target_dir: Path | None, target_vocab_size: int) -> None:
    """ConfigError unless the draft's vocabulary is the target's: the same vocab_size and, where both folders have a
    tokenizer.json, the same token -> id map (a proposal is an id; another tokenizer's id means another token)."""
    from overlap.engine.model.model_spec import read_spec

    draft_vocab = read_spec(draft_dir, None).vocab_size
    if draft_vocab != target_vocab_size:
        raise ConfigError(f"speculative_config: the draft model's vocabulary ({draft_vocab} tokens, {draft_dir}) "
                          f"differs from the target's ({target_vocab_size}); a draft must share the target's "
                          "tokenizer")  # fmt: skip
    if target_dir is None:
        return
    files = [Path(target_dir) / "tokenizer.json", draft_dir / "tokenizer.json"]
    if all(f.is_file() for f in files):
        target_map, draft_map = (_token_ids(f) for f in files)
        if target_map != draft_map:
            raise ConfigError(f"speculative_config: the draft model's tokenizer ({files[1]}) maps tokens to other ids "
                              f"than the target's ({files[0]}); a draft must share the target's tokenizer")  # fmt: skip


def _token_ids(tokenizer_json: Path) -> tuple[dict, list]:
    data = json.loads(tokenizer_json.read_text())
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    return data.get("model", {}).get("vocab"), added


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
