"""The prefix cache's block hashes and the log of blocks it adds and evicts: one definition for the engine and for a
router that scores replicas by what they hold (`overlap router`).

A full block of `block_size` tokens is keyed by (its parent block's hash, its token ids); the first block's parent is
ROOT_HASH. A block's hash is CPython's hash of that key: for tuples of ints it is deterministic, the same in every
64-bit CPython process on any host (no per-process seed: that applies to str and bytes only), so a router computes
the hashes an engine publishes from the token ids alone. The block size comes from the engine (its KV events say
which), never from a second setting. HASH_SCHEME names this definition; a router refuses any other.

`KvEventLog` numbers every change to the cache: +1 a block's hash became cached, -1 it was evicted. A reader asks
for the events after the last number it saw; one that fell behind the log's window gets a snapshot instead.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Iterable, Sequence

ROOT_HASH = 0x5EED  # parent hash of a sequence's first block
HASH_SCHEME = "cpython-tuple-v1"
STORED, REMOVED = 1, -1
KV_EVENT_WINDOW = 1 << 16  # events kept for readers that poll; one further behind gets a snapshot

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's hash, this block's token ids)


def extend_keys(keys: list[BlockKey], tokens: Sequence[int], block_size: int, num_full_blocks: int) -> list[BlockKey]:
    """Extend the hash chain `keys` (in place) over `tokens` to `num_full_blocks` full blocks."""
    while len(keys) < num_full_blocks:
        i = len(keys)
        parent = hash(keys[-1]) if keys else ROOT_HASH
        keys.append((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
    return keys


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of `tokens`, as an engine publishes them."""
    return [hash(key) for key in extend_keys([], tokens, block_size, len(tokens) // block_size)]


class KvEventLog:
    """Numbered (kind, block hash) events; `epoch` changes with every engine, so a reader notices a restart."""

    def __init__(self, window: int = KV_EVENT_WINDOW) -> None:
        self.epoch = os.urandom(8).hex()
        self.next_seq = 0  # the number the next event gets
        self._events: deque[tuple[int, int]] = deque(maxlen=window)

    def record(self, kind: int, block_hash: int) -> None:
        self._events.append((kind, block_hash))
        self.next_seq += 1

    def since(self, seq: int) -> list[tuple[int, int]] | None:
        """The events numbered seq .. next_seq - 1, or None when some of them left the window (or seq is not one
        this log gave out): the reader needs a snapshot."""
        first = self.next_seq - len(self._events)
        if seq < first or seq > self.next_seq:
            return None
        tail = list(itertools.islice(reversed(self._events), self.next_seq - seq))  # only the wanted events
        tail.reverse()
        return tail


def snapshot_events(hashes: Iterable[int]) -> list[tuple[int, int]]:
    """A snapshot as events: every cached block's hash, stored."""
    return [(STORED, h) for h in hashes]
