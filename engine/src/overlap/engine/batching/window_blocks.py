"""The KV blocks of a model's sliding-window layers, when it mixes them with full-attention layers (Gemma 2/3,
gpt-oss): a pool and block ids of their own, so a sliding layer's blocks go back once they fall out of its window
while the full layers keep theirs (`BlockManager` drives both; vLLM's hybrid KV cache manager does the same).

    full layers' table:     [3, 4, 5, 6, 7]           positions 0 .. 79, bs 16, every block held
    sliding layers' table:  [0, 0, 0, 12, 9]          window 24: the next query (position 80) sees keys 57 ..,
                                                       so blocks 0 .. 2 went back; 0 is the null block

Block 0 is the null block: never handed out, its slots zeroed by the runner, it stands for every block behind the
window, so a table keeps one entry per logical block and slot = table[pos // bs] * bs + pos % bs still holds where
anything reads. A query at position p sees keys p - window < k <= p, so a sequence whose next query is at p needs
blocks from (p - window + 1) // bs on: at most ceil((window - 1) / bs) + 1 of them, plus its next chunk's.

Blocks are taken as steps need them (`grow`), not for the whole prompt at admission: a long prompt holds at most
its window and one chunk at a time. Prefix caching: a full block keeps its key after it goes back, as in the full
layers' cache; a hit of h blocks needs the full layers' first h blocks and the sliding layers' blocks inside the
window of position h * bs (`cached_prefix`).
"""

from __future__ import annotations

from collections import OrderedDict

from overlap.engine.prefix_hash import BlockKey
from overlap.engine.requests.request import Request

NULL_BLOCK = 0


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        assert num_blocks >= 1 and window >= 1, "the sliding layers' pool needs a block and a window"
        self.num_blocks = num_blocks  # usable blocks, ids 1 .. num_blocks (the pool holds one more: the null block)
        self.block_size = block_size
        self.window = window
        self.ref_counts = [0] * (num_blocks + 1)
        self._block_keys: list[BlockKey | None] = [None] * (num_blocks + 1)
        self._cached: dict[BlockKey, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def first_block_needed(self, position: int) -> int:
        """The first logical block a query at `position` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.block_size

    @staticmethod
    def max_blocks_per_seq(window: int, block_size: int, num_new_tokens: int) -> int:
        """The most blocks one sequence holds at once when its steps add up to `num_new_tokens` tokens."""
        return -(-(window - 1) // block_size) + 1 + -(-num_new_tokens // block_size)

    @staticmethod
    def blocks_for(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """The blocks that `max_num_seqs` sequences at once need, each with its window, beside a step of
        `max_num_batched_tokens`: what the pool is sized for (`split_kv_pool`)."""
        per_seq = WindowBlocks.max_blocks_per_seq(window, block_size, 1)
        return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)

    def most_seqs(self, max_num_batched_tokens: int) -> int:
        """The most sequences this pool holds at once by the same rule (at least 1)."""
        step_only = self.blocks_for(self.window, self.block_size, 0, max_num_batched_tokens)
        return max(1, (self.num_blocks - step_only) // self.max_blocks_per_seq(self.window, self.block_size, 1))

    # ---- admission ---------------------------------------------------------------------------------------------
    def cached_prefix(self, keys: list[BlockKey], num_hits: int) -> int:
        """The most of the full layers' `num_hits` leading cached blocks that the sliding layers can use too: their
        blocks inside the window of the first position after the hit must be cached here as well."""
        for h in range(num_hits, 0, -1):
            if all(keys[i] in self._cached for i in range(self.first_block_needed(h * self.block_size), h)):
                return h
        return 0

    def num_to_take(self, request: Request, keys: list[BlockKey], num_hits: int, end: int) -> int:
        """Blocks leaving the free list when `request` starts with `num_hits` cached blocks and computes to `end`."""
        first = self.first_block_needed(num_hits * self.block_size)
        hits = [self._cached[keys[i]] for i in range(first, num_hits)]
        fresh = -(-end // self.block_size) - num_hits
        return max(0, fresh) + sum(1 for b in hits if self.ref_counts[b] == 0)

    def allocate(self, request: Request, keys: list[BlockKey], num_hits: int, end: int) -> None:
        """A table for `request`: its cached blocks inside the window of the hit, fresh ones up to position `end`
        (the caller checked `num_to_take`)."""
        assert not request.window_block_ids, f"request {request.request_id} already holds sliding-layer blocks"
        first = self.first_block_needed(num_hits * self.block_size)
        table = [NULL_BLOCK] * first
        for i in range(first, num_hits):
            block = self._cached[keys[i]]
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            table.append(block)
        request.window_block_ids = table
        request.num_window_registered = num_hits
        self.grow(request, end)

    # ---- during the request ------------------------------------------------------------------------------------
    def num_missing(self, request: Request, end: int) -> int:
        return max(0, -(-end // self.block_size) - len(request.window_block_ids))

    def num_tokens_fit(self, request: Request, num_new_tokens: int) -> int:
        """The most of `num_new_tokens` past the computed ones that the table and the free blocks can cover now."""
        room = (len(request.window_block_ids) + len(self._free)) * self.block_size - request.num_computed_tokens
        return min(num_new_tokens, room)

    def grow(self, request: Request, end: int) -> None:
        """Cover positions up to `end` (the caller checked `num_missing` against the free blocks)."""
        for _ in range(self.num_missing(request, end)):
            block = next(iter(self._free))
            del self._free[block]
            key = self._block_keys[block]
            if key is not None:  # evict: these tokens are no longer cached
                if self._cached.get(key) == block:
                    del self._cached[key]
                self._block_keys[block] = None
            self.ref_counts[block] = 1
            request.window_block_ids.append(block)

    def release_behind(self, request: Request, position: int) -> None:
        """Give back the blocks no query at `position` or later reads: the null block takes their place in the
        table (the steps in flight start at `position` or later, so none of them reads those entries)."""
        table = request.window_block_ids
        for i in range(min(self.first_block_needed(position), len(table))):
            if table[i] != NULL_BLOCK:
                self._release(table[i])
                table[i] = NULL_BLOCK

    def register(self, request: Request, keys: list[BlockKey], num_full: int) -> None:
        """Publish the full blocks below `num_full` that the request still holds."""
        table = request.window_block_ids
        num_full = min(num_full, len(table))
        for i in range(request.num_window_registered, num_full):
            block = table[i]
            if block != NULL_BLOCK and keys[i] not in self._cached and self._block_keys[block] is None:
                self._cached[keys[i]] = block
                self._block_keys[block] = keys[i]
        request.num_window_registered = max(request.num_window_registered, num_full)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding's rollback: the blocks past the first `num_tokens` positions go back."""
        keep = -(-num_tokens // self.block_size)
        table = request.window_block_ids
        while len(table) > keep:
            block = table.pop()
            if block != NULL_BLOCK:
                self._release(block)

    def free(self, request: Request) -> None:
        """Return every block of `request`, the last first (a shared prefix stays cached longest)."""
        for block in reversed(request.window_block_ids):
            if block != NULL_BLOCK:
                self._release(block)
        request.window_block_ids = []
        request.num_window_registered = 0

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"sliding-layer block {block} freed twice"
        if self.ref_counts[block] == 0:
            self._free[block] = None

    def check_invariants(self, holders: list[Request]) -> None:
        """Assert that reference counts match the tables of `holders` and the free list is exact (tests)."""
        expected = [0] * (self.num_blocks + 1)
        for request in holders:
            for block in request.window_block_ids:
                if block != NULL_BLOCK:
                    expected[block] += 1
        assert expected == self.ref_counts, "sliding-layer reference counts differ from the tables"
        assert set(self._free) == {b for b in range(1, self.num_blocks + 1) if expected[b] == 0}, "free list is wrong"
        for key, block in self._cached.items():
            assert self._block_keys[block] == key, f"cache entry for sliding-layer block {block} is inconsistent"
