"""LoRA adapters on the engine's side: the registry of names requests may give (`LoraRegistry`), and which adapter
each of the runner's `max_loras` device slots holds and how many running requests use it (`LoraSlots`).

A request through an adapter takes a slot when it is admitted (`can_acquire` / `acquire`) and gives it back when it
finishes or is preempted (`release`). An adapter already in a slot is shared; otherwise it waits at the queue's head
until the runner has it in host memory (`staged`: read off the step's thread; a folder that cannot be read fails the
adapter's waiting requests, no one else's), then goes into the slot idle longest (empty first), and the step that
first uses it carries the load (`take_loads` -> `ModelInput.lora_loads`,
which every tensor-parallel rank applies before its forward). A slot in use is never refilled, so a running request
always computes with the adapter it named, even after that adapter was unloaded from the engine's registry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from overlap.engine.errors import ConfigError, UnknownAdapterError

AdapterKey = tuple[str, str]  # (name, folder)


class LoraRegistry:
    """Adapter name -> PEFT folder, for every thread: `add` checks the folder first (`check`, the runner's
    `read_lora`, raises with the reason), `remove` stops new requests (accepted ones keep their folder and finish).
    `add(..., replace=True)` moves a loaded name to a new folder the same way: accepted requests keep the old one."""

    def __init__(self, enabled: bool, check: Callable[[str, str], object]) -> None:
        self.enabled = enabled
        self._check = check
        self._paths: dict[str, str] = {}
        self._lock = threading.Lock()

    def add(self, name: str, path: str, replace: bool = False) -> None:
        if not self.enabled:
            raise ConfigError("LoRA adapters need enable_lora (--enable-lora)")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ConfigError(f"a LoRA adapter needs a name and a path, got {name!r}, {path!r}")
        with self._lock:
            if name in self._paths and not replace:
                raise ConfigError(f"LoRA adapter {name!r} is already loaded (load_inplace moves it to a new folder)")
        self._check(name, path)
        with self._lock:
            self._paths[name] = path

    def remove(self, name: str) -> bool:
        """False if no adapter has that name."""
        with self._lock:
            return self._paths.pop(name, None) is not None

    def path_of(self, name: str) -> str:
        with self._lock:
            path = self._paths.get(name)
        if path is None:
            raise UnknownAdapterError(f"no LoRA adapter {name!r} is loaded")
        return path

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._paths)


class LoraSlots:
    """`max_loras` 0: LoRA is off (every request is the base model's)."""

    def __init__(self, max_loras: int, stage: Callable[[str, str], bool | str] | None = None) -> None:
        """`stage(name, folder)`: the runner's `stage_lora` (True once the adapter is read and held for a slot)."""
        self.max_loras = max_loras
        self._stage = stage
        self.holds: list[AdapterKey | None] = [None] * max_loras
        self.users = [0] * max_loras
        self._slot_of: dict[AdapterKey, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))  # oldest first
        self._loads: list[tuple[int, str, str]] = []
        self.info: tuple[list[str], list[str]] = ([], [])  # adapters of running and of waiting requests

    def can_acquire(self, request) -> bool:
        """Whether the request may start now: no adapter, or its adapter in a slot or a slot free for it."""
        return request.lora_name is None or (request.lora_name, request.lora_path) in self._slot_of or bool(self._idle)

    def staged(self, request) -> bool | str:
        """Whether the request's adapter can fill a slot now (True: none needed, or it is in a slot or read and held
        for one); False while the runner reads it; why it cannot be read. After can_acquire."""
        key = (request.lora_name, request.lora_path)
        if request.lora_name is None or key in self._slot_of or self._stage is None:
            return True
        return self._stage(*key)

    def acquire(self, request) -> None:
        """Give the request (through an adapter) its adapter's slot, filled now if needed; after can_acquire."""
        if request.lora_name is None:
            return
        key = (request.lora_name, request.lora_path)
        slot = self._slot_of.get(key)
        if slot is None:
            assert self._idle, "acquire without a free slot"
            slot = next(iter(self._idle))
            old = self.holds[slot]
            if old is not None:
                del self._slot_of[old]
            self.holds[slot], self._slot_of[key] = key, slot
            self._loads.append((slot, *key))
        self._idle.pop(slot, None)
        self.users[slot] += 1
        request.lora_slot = slot

    def release(self, request) -> None:
        """The request (finished or preempted) no longer uses its slot."""
        slot, request.lora_slot = request.lora_slot, -1
        if slot < 0:
            return
        assert self.users[slot] > 0, f"slot {slot} released more often than acquired"
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None  # the most recently used of the idle ones: evicted last

    def forget(self, loads: list[tuple[int, str, str]]) -> None:
        """These fills did not happen (their step failed: an adapter's folder could not be read): the slots hold
        nothing, so the adapter's next request fills its slot again rather than running on what the slot held."""
        for slot, name, path in loads:
            if self.holds[slot] == (name, path):
                self.holds[slot] = None
                del self._slot_of[name, path]

    def take_loads(self) -> list[tuple[int, str, str]]:
        """The (slot, name, folder) fills since the last call, for the next step."""
        loads, self._loads = self._loads, []
        return loads

    def observe(self, waiting) -> None:
        """Note the adapters of running and of `waiting` requests (`vllm:lora_requests_info`), replaced whole: other
        threads read `info`."""
        if self.max_loras:
            running = [key[0] for key, users in zip(self.holds, self.users, strict=True) if key is not None and users]
            self.info = (running, sorted({request.lora_name for request in waiting} - {None}))
