"""The prefix cache's block hashes and the log of blocks it adds and evicts: one definition for the engine and for a
router that scores replicas by what they hold (`overlap router`).

A full block of `block_size` tokens is keyed by (its parent block's hash, its token ids); the first block's parent
is ROOT_HASH, or for a request through a LoRA adapter `root_hash(adapter)`, the adapter being its (name, folder):
no KV is shared across adapters (nor with the base model), since every layer's K and V differ, and a name loaded
again from another folder is another adapter. A block's hash is CPython's hash of that key: for tuples
of ints it is deterministic, the same in every 64-bit CPython process on any host (no per-process seed: that applies
to str and bytes only), so a router computes the hashes an engine publishes from the token ids alone. The block size
comes from the engine (its KV events say which), never from a second setting. HASH_SCHEME names this definition; a
router refuses any other.

`KvEventLog` numbers every change to the cache: +1 a block's hash became cached, -1 it was evicted. A reader asks
for the events after the last number it saw; one that fell behind the log's window gets a snapshot instead.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import deque
from collections.abc import Iterable, Sequence

ROOT_HASH = 0x5EED  # parent hash of a sequence's first block
HASH_SCHEME = "cpython-tuple-v1"
STORED, REMOVED = 1, -1
KV_EVENT_WINDOW = 1 << 16  # events kept for readers that poll; one further behind gets a snapshot

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's hash, this block's token ids)
Adapter = tuple[str, str]  # a LoRA adapter as its KV knows it: (name, folder); /v1/models gives the folder as `root`


def root_hash(adapter: Adapter | None = None) -> int:
    """The first block's parent: ROOT_HASH for the base model; for a LoRA adapter one derived from its name and
    folder with a hash that is the same in every process (str's built-in hash is seeded per process)."""
    if adapter is None:
        return ROOT_HASH
    digest = hashlib.blake2b("\0".join(adapter).encode(), digest_size=8).digest()
    return hash((ROOT_HASH, int.from_bytes(digest)))


def extend_keys(keys: list[BlockKey], tokens: Sequence[int], block_size: int, num_full_blocks: int,
                root: int = ROOT_HASH) -> list[BlockKey]:  # fmt: skip
    """Extend the hash chain `keys` (in place) over `tokens` to `num_full_blocks` full blocks; `root` is the first
    block's parent (`root_hash`)."""
    while len(keys) < num_full_blocks:
        i = len(keys)
        parent = hash(keys[-1]) if keys else root
        keys.append((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
    return keys


def block_hashes(tokens: Sequence[int], block_size: int, adapter: Adapter | None = None) -> list[int]:
    """The hashes of every full block of `tokens` (through LoRA `adapter`), as an engine publishes them."""
    keys = extend_keys([], tokens, block_size, len(tokens) // block_size, root_hash(adapter))
    return [hash(key) for key in keys]


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
