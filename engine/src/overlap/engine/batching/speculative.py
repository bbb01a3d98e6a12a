"""Speculative decoding's proposer (prompt lookup, vLLM's `ngram` method), run on the host by the scheduler.

The last n tokens of a sequence (prompt + output), n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked
up earlier in the same sequence; the tokens that followed their latest earlier occurrence, at most k of them, are the
proposal; where fewer than k follow before the sequence's end, the copy continues over the tokens it has just
proposed (a sequence that repeats with period p goes on repeating). The target model then scores the sequence's last
token and the k proposed ones in one step (docs/engine.md, "Speculative decoding"). The search runs in C: the token
ids as 4-byte words and `bytes.rfind` over them.
"""

from __future__ import annotations

from array import array

from overlap.engine.config import SpeculativeConfig


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


class NgramProposer:
    """The `ngram` method of a SpeculativeConfig: `propose(tokens, k)` with its lookup bounds."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.k = config.num_speculative_tokens

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return propose_ngram(tokens, self.min_n, self.max_n, min(k, self.k))
