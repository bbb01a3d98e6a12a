"""Speculative decoding's proposers and the rule for how many tokens a sequence proposes, run by the scheduler.

A proposer (`Proposer`) is prompt lookup (vLLM's `ngram` method, here) or a draft model (`draft_model`, in
model/draft.py: it runs a model, which lives a layer above the scheduler, so the engine builds it and hands it in).

The last n tokens of a sequence (prompt + output), n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked
up earlier in the same sequence; the tokens that followed their latest earlier occurrence, at most k of them, are the
proposal; where fewer than k follow before the sequence's end, the copy continues over the tokens it has just
proposed (a sequence that repeats with period p goes on repeating). The target model then scores the sequence's last
token and the k proposed ones in one step (docs/engine.md, "Speculative decoding"). The search runs in C: the token
ids as 4-byte words and `bytes.rfind` over them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol

from overlap.engine.config import SpeculativeConfig
from overlap.engine.requests.request import Request

# A step's rows (decodes plus proposals) past which speculation stops: a row costs 2 FLOPs per weight and a decode
# step streams every weight once, so a step stops being bound by the weights' bytes at about
# peak FLOP/s x bytes per weight / (2 x bandwidth) rows, and past that a rejected proposal costs real time. The
# figures are the documented balances, not measured at start-up (docs/engine.md, "When a sequence speculates"):
# cpu, the 2-core AMD EPYC of docs/engine.md (bf16 projections ~550 GFLOP/s and fp32 ~430 against ~47 GB/s:
# 12 and 18 rows); cuda, an H100 SXM (989 dense bf16 TFLOP/s against 3.35 TB/s: 295 rows).
COMPUTE_BOUND_ROWS = {"cpu": 16, "cuda": 256}
SPEC_ACCEPTANCE_DECAY = 0.5  # weight of a sequence's latest try in its average acceptance
SPEC_MAX_BACKOFF = 16  # most plain decodes a request runs between tries to speculate (scheduler.py's module doc)


def compute_bound_rows(device_type: str) -> int:
    return COMPUTE_BOUND_ROWS.get(device_type, COMPUTE_BOUND_ROWS["cuda"])


def num_to_propose(accepted_avg: float | None, k_max: int) -> int:
    """A sequence's next k: one more than the proposals it has recently had accepted (an exponential average over its
    tries, `SPEC_ACCEPTANCE_DECAY` for the latest), at most k_max; k_max before its first try. A sequence whose
    proposals are all accepted keeps k_max; one that keeps only the first proposes 2, none: 1 (and backs off)."""
    if accepted_avg is None:
        return k_max
    return max(1, min(k_max, int(accepted_avg) + 1))


def record_acceptance(request: Request, accepted: int) -> None:
    """Fold one verifying step's accepted proposals into the request's average (see num_to_propose); a try that
    gains nothing backs off, one that gains anything resets the back-off. A try that sat a step out for its token in
    flight gains only past the token that step would have decoded: one accepted proposal merely wins it back."""
    if request.spec_accepted_avg is None:
        request.spec_accepted_avg = float(accepted)
    else:
        decay = SPEC_ACCEPTANCE_DECAY
        request.spec_accepted_avg = decay * accepted + (1 - decay) * request.spec_accepted_avg
    if accepted > int(request.spec_waited):
        request.spec_backoff = 0
        request.spec_waited = False
    else:
        back_off(request)


def back_off(request: Request) -> None:
    """A try that gained nothing: 1, 2, 4, .. SPEC_MAX_BACKOFF plain decodes before the next."""
    request.spec_backoff = min(2 * request.spec_backoff or 1, SPEC_MAX_BACKOFF)
    request.spec_skip = request.spec_backoff
    request.spec_waited = False


@dataclass(slots=True)
class SpecDecodeCounters:
    """vLLM's spec_decode counters: steps that verified proposals, proposals, accepted ones, and accepted ones by
    position (index 0: the first proposal of a step)."""

    accepted_per_position: list[int]  # k zeros to start with
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def stats(self) -> dict:
        """As Engine.stats() names them."""
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }


def _num_to_ask(request: Request, proposer: Proposer, budget: int, max_seq_len: int) -> int:
    """k for the request's next decode (< 1: a plain one): from its recent acceptance, and never past max_tokens,
    max_seq_len or `budget` rows (its own and its proposals'); the step appends up to k + 1 tokens."""
    if request.sampling.grammar is not None:
        return 0
    return min(
        num_to_propose(request.spec_accepted_avg, proposer.k),
        request.sampling.max_tokens - request.num_output_tokens - request.num_placeholders - 1,
        max_seq_len - request.num_tokens - request.num_placeholders - 1,
        budget - 1,
    )


def prepare(proposer: Proposer, running: list[Request], budget: int, room: int, max_seq_len: int) -> None:
    """Before a step's decodes: hand the proposer the requests likely to propose in it, with their k, in the
    scheduler's order and under the same caps, so a draft model runs them as one batch (`proposals_for` then takes
    each one's share; one it did not foresee is proposed for alone)."""
    wanted = []
    for request in running:
        if request.num_placeholders or request.spec_skip or request.num_tokens - request.num_computed_tokens != 1:
            continue
        k = _num_to_ask(request, proposer, min(budget, room + 1), max_seq_len)
        if k >= 1:
            wanted.append((request, k))
            budget, room = budget - 1 - k, room - k
    if wanted:
        proposer.prepare(wanted)


def proposals_for(request: Request, proposer: Proposer, budget: int, max_seq_len: int) -> list[int] | None:
    """The proposals for `request`'s next decode ([] for a plain decode), or None when it is due to speculate but a
    step of its own is in flight (it sits this step out; scheduler.py's module doc). `budget`: the rows it may take
    (its own and its proposals')."""
    k = _num_to_ask(request, proposer, budget, max_seq_len)
    if k < 1:
        return []
    if request.spec_skip > 0:
        request.spec_skip -= 1
        return []
    if request.num_placeholders:
        # Its last token is in flight. Sit this step out only if the proposer expects to find something (ngram:
        # the tokens known so far already end in an n-gram seen before); else decode on, overlapped, and look
        # again at the next step: a pause that finds nothing to propose would cost a step for nothing.
        if not proposer.probe(request):
            return []
        request.spec_waited = True
        return None
    drafts = proposer.propose(request, k)
    if not drafts:
        back_off(request)
    return drafts


class Proposer(Protocol):
    """What the scheduler asks of a proposer: at most k tokens to follow the request's tokens ([]: none), whether
    a request whose last token is in flight is worth a pause for it (`probe`), and to drop a finished request's
    state."""

    k: int  # num_speculative_tokens

    def prepare(self, wanted: list[tuple[Request, int]]) -> None:
        """The (request, k) pairs this step will likely ask for: a proposer that batches computes them now."""

    def propose(self, request: Request, k: int) -> list[int]: ...

    def probe(self, request: Request) -> bool: ...

    def forget(self, request_ids: list[str]) -> None: ...


def propose_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of `tokens`, for the largest
    n in max_n .. min_n that occurs earlier; [] when none does (or k < 1)."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    words = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = words[-4 * n :]
        end = len(words) - 4  # an occurrence must end before the last token (the suffix itself is no match)
        while True:
            at = words.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:  # aligned on a token, not straddling two
                follow = at // 4 + n
                proposal = tokens[follow : follow + k]
                period = length - follow
                while len(proposal) < k:  # the match runs into the suffix: the copy overlaps itself (as LZ77's)
                    proposal.append(proposal[len(proposal) - period])
                return proposal
            end = at + len(pattern) - 1
    return []


class NgramProposer(Proposer):
    """The `ngram` method of a SpeculativeConfig: prompt lookup over the request's tokens, with its bounds."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, request: Request, k: int) -> list[int]:
        return propose_ngram(request.all_token_ids, self.min_n, self.max_n, min(k, self.k))

    def probe(self, request: Request) -> bool:
        # do the tokens known so far already end in an n-gram seen before? (then the whole sequence likely does too)
        return bool(propose_ngram(request.all_token_ids, self.min_n, self.max_n, 1))

    def forget(self, request_ids: list[str]) -> None:
        pass  # it keeps nothing per request
