"""The router's choice of a replica: what each replica's prefix cache holds (an index fed by the engines' KV events,
or, for comparison, the router's own record of what it sent where), each replica's load, and session affinity.

Policy `prefix` (and `approx`, the same with the router-side index) picks the replica where the request's prefill
would start and finish soonest, estimated in prompt tokens of work:

    cost(r) = the prompt tokens r does not hold                (its leading cached blocks cost nothing)
            + r's prefill backlog                              (uncached tokens of the requests this router sent it
                                                                that have not started streaming yet)
            + DECODE_TOKENS x its requests already streaming   (each decode adds to every step)
            + U x its waiting requests this router did not send (other clients; from its last poll)
            + FULL_KV_PENALTY x U if its KV cache is over 95% full (it would evict or preempt to take it)
            - SESSION_BONUS x U if the request's session went to r last
            + ADAPTER_LOAD x U if the request names a LoRA adapter r has not loaded (it reads it into a slot first)

U is the mean uncached prompt of the requests routed so far (a moving average). The backlog is the router's own
and exact at the moment of the pick, so a burst spreads at once; a group's requests stay where its prefix is
cached until that replica's backlog costs more than computing the prompt elsewhere. Ties go to the fewest
requests in flight. The other policies are the baselines a benchmark compares with: `least-queue`, `round-robin`,
`random` (what a plain Kubernetes Service does).

LoRA adapters: every replica registers the same adapters (the same `--lora-modules`, or the operator's pass that
loads spec.adapters into every ready pod), but one that has not yet (a new pod before that pass) answers 404, so
a request for adapter X goes only to replicas that list X in their /v1/models (to any, if none does: the replica's
404 then names what is served). Registered is not loaded: an engine keeps a few adapters in device slots and host
memory and reads another from its folder on first use. A replica has X loaded, as far as the router can tell, while
this router has requests for X running there, or when X's last request went there (a slot is refilled only when
its adapter is idle longest). Elsewhere X costs ADAPTER_LOAD x U more, so X's requests stay on the replica that
holds it until its load costs more; if none holds it, they go to the least loaded, which then holds it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

POLICIES = ("prefix", "approx", "least-queue", "round-robin", "random")


class PrefixIndex:
    """Which replicas hold which block hashes. Fed by KV events (`apply`) or by the router's own picks (`record`,
    least recently used first out past `capacity` blocks per replica)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())

    def apply(self, replica: str, events: list, reset: bool) -> None:
        """An engine's KV events, in order: (+1, hash) stored, (-1, hash) evicted; reset: they are a snapshot."""
        if reset:
            self.drop(replica)
        for kind, block_hash in events:
            if kind > 0:
                self._add(replica, block_hash)
            else:
                self._remove(replica, block_hash)

    def record(self, replica: str, hashes: list[int]) -> None:
        """The router sent a prompt with these blocks to `replica`: it will hold them (router-side tracking)."""
        for block_hash in hashes:
            self._add(replica, block_hash)
        blocks = self._blocks.get(replica)
        while self.capacity is not None and blocks and len(blocks) > self.capacity:
            self._remove(replica, next(iter(blocks)))

    def drop(self, replica: str) -> None:
        for block_hash in list(self._blocks.get(replica, ())):
            self._remove(replica, block_hash)
        self._blocks.pop(replica, None)

    def matches(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """Per replica, how many leading blocks of `hashes` it holds."""
        matched = dict.fromkeys(replicas, 0)
        candidates = set(replicas)
        for i, block_hash in enumerate(hashes):
            holders = self._holders.get(block_hash, set())
            for replica in candidates - holders:
                matched[replica] = i
            candidates &= holders
            if not candidates:
                return matched
        for replica in candidates:
            matched[replica] = len(hashes)
        return matched

    def _add(self, replica: str, block_hash: int) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return
        blocks[block_hash] = None
        self._holders.setdefault(block_hash, set()).add(replica)

    def _remove(self, replica: str, block_hash: int) -> None:
        blocks = self._blocks.get(replica)
        if blocks is None or block_hash not in blocks:
            return
        del blocks[block_hash]
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]


@dataclass
class ReplicaState:
    """What the router knows of one replica: from its KV-event polls and its own requests in flight."""

    url: str
    ready: bool = False
    draining: bool = False
    epoch: str = ""
    next_seq: int = 0
    block_size: int | None = None
    load: dict = field(default_factory=dict)  # num_waiting, num_running, kv_usage, queued, inflight
    in_flight: int = 0  # requests this router has sent and not yet seen finish
    starting: int = 0  # of which not streaming yet
    backlog_tokens: int = 0  # their uncached prompt tokens
    failed_polls: int = 0  # KV-event polls failed in a row (the router's DOWN_AFTER_FAILED_POLLS marks it down)
    models: list[dict] = field(default_factory=list)  # its /v1/models entries: the base model, then its adapters
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it serves (the entries with a parent)
    adapter_folders: dict[str, str] = field(default_factory=dict)  # adapter -> its folder there (`root`)
    adapter_requests: dict[str, int] = field(default_factory=dict)  # adapter -> this router's requests in flight

    def set_models(self, models: object) -> None:
        """From its /v1/models `data`; anything else there counts as no model."""
        models = models if isinstance(models, list) else []
        self.models = [m for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]
        self.adapters = frozenset(m["id"] for m in self.models if m.get("parent"))
        self.adapter_folders = {m["id"]: str(m.get("root", "")) for m in self.models if m.get("parent")}

    @property
    def queue(self) -> int:
        return int(self.load.get("num_waiting", 0)) + int(self.load.get("queued", 0)) + self.in_flight


@dataclass
class Pick:
    replica: ReplicaState
    reason: str  # prefix | session | adapter | load | random | round-robin | only
    hit_blocks: int = 0
    adapter_loaded: bool = False  # the request names a LoRA adapter that the replica has loaded


DECODE_TOKENS = 16  # a streaming request's share of each step, in prompt tokens
SESSION_BONUS = 2.0  # in mean uncached prompts
FULL_KV_PENALTY = 4.0
FULL_KV = 0.95
ADAPTER_LOAD = 1.0  # in mean uncached prompts: reading an adapter into a slot, and the wait for a free slot


class Picker:
    def __init__(self, policy: str, approx_capacity: int = 8192, seed: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.index = PrefixIndex()  # from the engines' KV events
        self.approx = PrefixIndex(capacity=approx_capacity)  # from this router's own picks
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica url, most recent last
        self.max_sessions = 100_000
        self.adapter_homes: OrderedDict[str, str] = OrderedDict()  # LoRA adapter -> the replica its last request went
        self.mean_uncached = 256.0  # U: tokens, a moving average over routed requests
        self._rng = random.Random(seed)
        self._next = 0

    def pick(self, candidates: list[ReplicaState], hashes: list[int], block_size: int, num_tokens: int,
             session: str | None = None, adapter: str | None = None) -> Pick:  # fmt: skip
        """The replica for a request of `num_tokens` prompt tokens whose full blocks have these hashes (candidates:
        ready, not draining), through LoRA `adapter` (None: the base model)."""
        if adapter is not None:
            candidates = [r for r in candidates if adapter in r.adapters] or candidates
        pick = self._pick(candidates, hashes, block_size, num_tokens, session, adapter)
        pick.adapter_loaded = adapter is not None and self.has_loaded(pick.replica, adapter)
        return pick

    def has_loaded(self, replica: ReplicaState, adapter: str) -> bool:
        return replica.adapter_requests.get(adapter, 0) > 0 or self.adapter_homes.get(adapter) == replica.url

    def _pick(self, candidates: list[ReplicaState], hashes: list[int], block_size: int, num_tokens: int,
              session: str | None, adapter: str | None) -> Pick:  # fmt: skip
        if len(candidates) == 1:
            return Pick(candidates[0], "only", self._hits(candidates, hashes).get(candidates[0].url, 0))
        if self.policy == "random":
            return Pick(self._rng.choice(candidates), "random")
        if self.policy == "round-robin":
            self._next += 1
            return Pick(candidates[self._next % len(candidates)], "round-robin")
        if self.policy == "least-queue":
            return Pick(min(candidates, key=lambda r: (r.queue, self._rng.random())), "load")
        hits = self._hits(candidates, hashes)
        last = self.sessions.get(session) if session else None
        unit = self.mean_uncached

        def cost(r: ReplicaState, with_affinity: bool = True) -> tuple[float, int]:
            others_waiting = max(0, int(r.load.get("num_waiting", 0)) + int(r.load.get("queued", 0)) - r.starting)
            value = max(num_tokens - hits[r.url] * block_size, 0) + r.backlog_tokens
            value += DECODE_TOKENS * (r.in_flight - r.starting) + unit * others_waiting
            if float(r.load.get("kv_usage", 0.0)) > FULL_KV:
                value += FULL_KV_PENALTY * unit
            if with_affinity and last == r.url:
                value -= SESSION_BONUS * unit
            if with_affinity and adapter is not None and not self.has_loaded(r, adapter):
                value += ADAPTER_LOAD * unit
            return value, r.in_flight

        best = min(candidates, key=cost)
        by_load = min(candidates, key=lambda r: cost(r, False))
        if last == best.url and by_load is not best:
            reason = "session"
        elif adapter is not None and by_load is not best:
            reason = "adapter"
        elif hits[best.url] > 0 and hits[best.url] >= max(hits.values()):
            reason = "prefix"
        else:
            reason = "load"
        return Pick(best, reason, hits[best.url])

    @staticmethod
    def uncached(pick: Pick, block_size: int, num_tokens: int) -> int:
        """The prompt tokens `pick.replica` will compute for the request."""
        return max(num_tokens - pick.hit_blocks * block_size, 1)

    def routed(self, pick: Pick, hashes: list[int], block_size: int, num_tokens: int, session: str | None,
               adapter: str | None = None) -> None:  # fmt: skip
        """After a request went to `pick.replica`: remember its session, where its adapter is loaded, its uncached
        share and (router-side tracking) its blocks."""
        for key, seen in ((session, self.sessions), (adapter, self.adapter_homes)):
            if key:
                seen[key] = pick.replica.url
                seen.move_to_end(key)
                if len(seen) > self.max_sessions:
                    seen.popitem(last=False)
        if num_tokens:
            self.mean_uncached += 0.05 * (self.uncached(pick, block_size, num_tokens) - self.mean_uncached)
        if self.policy == "approx":
            self.approx.record(pick.replica.url, hashes)

    def _hits(self, candidates: list[ReplicaState], hashes: list[int]) -> dict[str, int]:
        index = self.approx if self.policy == "approx" else self.index
        return index.matches(hashes, [r.url for r in candidates])
