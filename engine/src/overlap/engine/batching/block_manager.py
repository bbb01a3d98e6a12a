"""The KV block manager: which request owns which slots of the runner's preallocated KV pool.

Layout (the runner allocates the pool once; this module only hands out block ids)::

    pool, per layer, K and V:   block 0          block 1          block 2          ...  block N-1
                                [slot 0 .. bs-1] [slot 0 .. bs-1] [slot 0 .. bs-1]      [..]

    a request's block table maps logical block i (positions i*bs .. i*bs + bs - 1) to a physical block:
        request A, 40 tokens, bs 16:   table [3, 4, 5]      (block 5 holds positions 32..39, 8 slots free)
        slot(pos) = table[pos // bs] * bs + pos % bs

    prefix cache: a full block is published under key (parent block's hash, its bs token ids; `prefix_hash.py`);
    a later request whose leading blocks have the same keys reuses them (reference count + 1):
        request B, same first 32 tokens as A:   table [3, 4, 9]   (blocks 3 and 4 have ref_count 2)

    free list: blocks with ref_count 0, least recently freed first. A freed full block keeps its key, so it
    is still a cache hit, until the free list hands it out for other tokens (LRU eviction).

A request's whole prompt is reserved at admission (`allocate`), so the hot path only ever adds the odd next
block for decode (`append_slots`).

Placement: the runner reads a block table that is one run of consecutive ids as a view of the pool and must
gather anything else, so the manager keeps tables contiguous where it can. At admission it looks (first fit,
`bytearray.find`) for a run of free blocks long enough for the prompt *and* the request's remaining max_tokens,
takes the prompt's blocks from its start and *claims* the rest: claimed blocks stay free (they count as free,
and anyone can still get them when nothing else is left), but later placements skip them, so the decode steps
find the next id free. Runs of never-cached blocks are preferred over runs that would evict cached ones; with no
run at all it falls back to the LRU free list.

    pool:   [A A A a a a . . B B b b b b . .]     A = A's blocks, a = claimed for A's growth, . = free

Only blocks below a request's computed length are ever shared, and nothing writes there again, so a shared
block is read-only by construction.

A model that mixes sliding-window and full-attention layers keeps its sliding layers' K/V in a pool of their own
(`window`, batching/window_blocks.py): the tables above are the full layers'; every method here keeps the sliding
layers' table in step with them, and a request is admitted or grows only when both pools have room.
"""

from __future__ import annotations

from collections import OrderedDict

from overlap.engine.batching.window_blocks import WindowBlocks
from overlap.engine.prefix_hash import REMOVED, STORED, BlockKey, KvEventLog, extend_keys, root_hash
from overlap.engine.requests.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: WindowBlocks | None = None) -> None:  # fmt: skip
        assert num_blocks >= 1 and block_size >= 1, "the KV pool needs at least one block of one slot"
        self.window = window  # the sliding layers' blocks, for a model that mixes layer types (else None)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}  # key -> block id holding those tokens' K/V
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Placement maps, one byte per block: free and unclaimed (any run may start here), and the same without
        # a cached key (placing there evicts nothing); `_claimed` marks blocks kept for a request's growth.
        self._placeable = bytearray(b"\x01" * num_blocks)
        self._empty = bytearray(b"\x01" * num_blocks)
        self._claimed = bytearray(num_blocks)
        self._runs: dict[int, bytes] = {}  # run length -> b"\x01" * length (search patterns)
        self.kv_events = KvEventLog()  # what the cache adds and evicts, for a prefix-aware router
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which served from the cache

    # ---- sizes -------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission ---------------------------------------------------------------------------------------------
    def _cache_hits(self, request: Request) -> list[int]:
        """Leading blocks of `request` already in the pool. At least one token is always left to compute, since
        the forward pass must produce the logits of the last one."""
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt position, so the whole prompt is computed
        max_hits = (request.num_tokens - 1) // self.block_size
        keys = self._keys_for(request, max_hits)
        hits = []
        for key in keys[:max_hits]:
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        if self.window is not None and hits:  # the sliding layers need the blocks in the window of the hit too
            del hits[self.window.cached_prefix(keys, len(hits)) :]
        return hits

    def _num_blocks_to_take(self, request: Request, hits: list[int]) -> int:
        fresh = self.num_blocks_for(request.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)  # cached but free: they leave the free list
        return fresh + revived

    def _window_end(self, request: Request, hits: list[int], num_new_tokens: int | None) -> int:
        """The position up to which the sliding layers' blocks are taken at admission: its first step's tokens."""
        start = len(hits) * self.block_size
        return request.num_tokens if num_new_tokens is None else min(request.num_tokens, start + num_new_tokens)

    def can_allocate(self, request: Request, num_new_tokens: int | None = None) -> bool:
        return self._fits(request, self._cache_hits(request), num_new_tokens)

    def _fits(self, request: Request, hits: list[int], num_new_tokens: int | None) -> bool:
        if self._num_blocks_to_take(request, hits) > len(self._free):
            return False
        if self.window is None:
            return True
        keys = self._keys_for(request, len(hits))
        end = self._window_end(request, hits, num_new_tokens)
        return self.window.num_to_take(request, keys, len(hits), end) <= self.window.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int | None = None) -> int | None:
        """Reserve blocks for all of `request`'s current tokens (prompt, plus any output kept across a
        preemption), and the sliding layers' for its first `num_new_tokens` to compute (None: all of them). Returns
        the number of tokens served from the prefix cache (and sets `num_computed_tokens` to it), or None if the
        pool cannot hold them now."""
        assert not request.block_ids, f"request {request.request_id} already holds KV blocks"
        hits = self._cache_hits(request)
        if not self._fits(request, hits, num_new_tokens):
            return None
        if self.window is not None:
            keys = self._keys_for(request, len(hits))
            self.window.allocate(request, keys, len(hits), self._window_end(request, hits, num_new_tokens))
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._free[block]
                self._unmark(block)
            self.ref_counts[block] += 1
        num_hits = len(hits)
        num_now = self.num_blocks_for(request.num_tokens) - num_hits
        remaining_output = max(0, request.sampling.max_tokens - request.num_output_tokens)
        num_want = self.num_blocks_for(request.num_tokens + remaining_output) - num_hits
        request.block_ids = hits + self._place(request, num_now, num_want, hits[-1] if hits else None)
        request.num_registered_blocks = num_hits
        num_cached = num_hits * self.block_size
        request.num_computed_tokens = num_cached
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached
        return num_cached

    # ---- growth during decode ----------------------------------------------------------------------------------
    def num_blocks_missing(self, request: Request, num_new_tokens: int) -> int:
        return max(0, self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids))

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make sure `request`'s blocks cover `num_new_tokens` more computed tokens; False if the pool is out."""
        missing = self.num_blocks_missing(request, num_new_tokens)
        if missing > len(self._free):
            return False
        if self.window is not None:
            end = request.num_computed_tokens + num_new_tokens
            if self.window.num_missing(request, end) > self.window.num_free_blocks:
                return False
            self.window.grow(request, end)
        if missing == 0:
            return True
        for _ in range(missing):
            nxt = request.block_ids[-1] + 1 if request.block_ids else self.num_blocks
            if nxt < request.claim_end and nxt in self._free:
                self._take_block(nxt)
                request.block_ids.append(nxt)
            else:  # its claim is used up or someone had to take it: any free block will do
                if request.claim_end:
                    self._release_claim(request, nxt)
                request.block_ids.extend(self._take_lru(1))
        return True

    def _place(self, request: Request, num_now: int, num_want: int, after: int | None) -> list[int]:
        """Take `num_now` blocks for a new table, as the head of a free run of `num_want` whose tail is claimed for
        the request's growth; falls back to shorter runs, then to the LRU free list."""
        if num_now == 0:
            return []
        start = None
        behind = after + 1 if after is not None else self.num_blocks  # right behind its cached prefix
        if behind + num_want <= self.num_blocks and self._placeable[behind : behind + num_want] == self._run(num_want):
            start = behind
        if start is None:
            for length in dict.fromkeys((num_want, num_now)):  # with growth room, else without
                start = self._find_run(length)
                if start is not None:
                    num_want = length
                    break
        if start is None:
            return self._take_lru(num_now)
        blocks = list(range(start, start + num_now))
        for block in blocks:
            self._take_block(block)
        for block in range(start + num_now, start + num_want):
            self._claimed[block] = 1
            self._unmark(block)
        request.claim_end = start + num_want
        return blocks

    def _find_run(self, length: int) -> int | None:
        """First block of the first run of `length` placeable blocks, preferring runs that evict no cached tokens."""
        pattern = self._run(length)
        start = self._empty.find(pattern)
        if start < 0:
            start = self._placeable.find(pattern)
        return start if start >= 0 else None

    def _run(self, length: int) -> bytes:
        pattern = self._runs.get(length)
        if pattern is None:
            pattern = self._runs[length] = b"\x01" * length
        return pattern

    def _take_lru(self, n: int) -> list[int]:
        taken = []
        for _ in range(n):
            block = next(iter(self._free))
            self._take_block(block)
            taken.append(block)
        return taken

    def _take_block(self, block: int) -> None:
        """Move a free block to its new owner (reference count 1), evicting its cached tokens if any."""
        del self._free[block]
        self._unmark(block)
        self._claimed[block] = 0
        key = self._block_keys[block]
        if key is not None:  # evict: these tokens are no longer cached
            if self._cached.get(key) == block:
                del self._cached[key]
                self.kv_events.record(REMOVED, hash(key))
            self._block_keys[block] = None
        self.ref_counts[block] = 1

    def _unmark(self, block: int) -> None:
        self._placeable[block] = 0
        self._empty[block] = 0

    def _mark_free(self, block: int) -> None:
        if not self._claimed[block]:
            self._placeable[block] = 1
            self._empty[block] = self._block_keys[block] is None

    def _release_claim(self, request: Request, first: int) -> None:
        for block in range(first, request.claim_end):
            if self._claimed[block]:
                self._claimed[block] = 0
                if self.ref_counts[block] == 0:
                    self._mark_free(block)
        request.claim_end = 0

    def trim(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding's rollback: release `request`'s blocks past those covering its first `num_tokens`
        positions, which held only the K/V of rejected proposals (slots inside a kept block need nothing: the
        request's computed length ends before them, nothing reads them, and its next step writes them first). Such
        blocks lie past the computed length, so they were never shared or published: each goes straight back to the
        free list, and one taken from the request's claimed run is claimed for it again."""
        keep = self.num_blocks_for(num_tokens)
        if self.window is not None:
            self.window.trim(request, num_tokens)
        while len(request.block_ids) > keep:
            block = request.block_ids.pop()
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] == 0 and self._block_keys[block] is None, f"block {block} is shared"
            self._free[block] = None
            if request.claim_end:  # the table grew through the claim, so this block is next to the kept ones
                self._claimed[block] = 1
                self._unmark(block)
            else:
                self._mark_free(block)

    # ---- release -----------------------------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Return `request`'s blocks. Tail blocks go on the free list first, so they are evicted first and a
        prefix that other requests share stays cached longest."""
        if request.claim_end:
            self._release_claim(request, request.block_ids[-1] + 1 if request.block_ids else 0)
        if self.window is not None:
            self.window.free(request)
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None
                self._mark_free(block)
        request.block_ids = []
        request.num_registered_blocks = 0
        request.num_computed_tokens = 0

    # ---- prefix cache ------------------------------------------------------------------------------------------
    def _keys_for(self, request: Request, num_full_blocks: int) -> list[BlockKey]:
        """Extend the request's hash chain to cover `num_full_blocks` blocks of its tokens."""
        adapter = None if request.lora_name is None else (request.lora_name, request.lora_path)
        return extend_keys(request.block_hashes, request.all_token_ids, self.block_size, num_full_blocks,
                           root_hash(adapter))  # fmt: skip

    def register_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks whose K/V is now written (call after the step that computed them); the
        sliding layers' blocks behind the window of the next position go back."""
        if self.window is not None:
            if self.enable_prefix_caching:  # published before they go back, so they stay cached in the free list
                num_full = num_computed_tokens // self.block_size
                self.window.register(request, self._keys_for(request, num_full), num_full)
            self.window.release_behind(request, num_computed_tokens)
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_registered_blocks:
            return
        keys = self._keys_for(request, num_full)
        for i in range(request.num_registered_blocks, num_full):
            block = request.block_ids[i]
            if keys[i] not in self._cached and self._block_keys[block] is None:
                self._cached[keys[i]] = block
                self._block_keys[block] = keys[i]
                self.kv_events.record(STORED, hash(keys[i]))
        request.num_registered_blocks = num_full

    def cached_hashes(self) -> list[int]:
        """The hash of every block the prefix cache holds now (a router's snapshot)."""
        return [hash(key) for key in self._cached]

    # ---- checks (tests) ----------------------------------------------------------------------------------------
    def check_invariants(self, holders: list[Request]) -> None:
        """Assert that reference counts match the block tables of `holders` and the free list is exact."""
        expected = [0] * self.num_blocks
        for request in holders:
            for block in request.block_ids:
                expected[block] += 1
        assert expected == self.ref_counts, "reference counts differ from the block tables"
        assert set(self._free) == {b for b in range(self.num_blocks) if expected[b] == 0}, "free list is wrong"
        for key, block in self._cached.items():
            assert self._block_keys[block] == key, f"cache entry for block {block} is inconsistent"
        claim_ranges = [range(r.block_ids[-1] + 1, r.claim_end) for r in holders if r.claim_end]
        for block in range(self.num_blocks):
            placeable = expected[block] == 0 and not self._claimed[block]
            assert self._placeable[block] == placeable, f"block {block}: placeable map is wrong"
            assert self._empty[block] == (placeable and self._block_keys[block] is None), f"block {block}: empty map"
            if self._claimed[block]:
                assert any(block in c for c in claim_ranges), f"block {block} is claimed by no running request"
