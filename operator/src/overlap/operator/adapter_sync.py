"""The adapters of spec.adapters loaded into, and unloaded from, each ready pod through its sidecar's admin port
(GET /admin/lora, POST /admin/lora/load and /admin/lora/unload, vLLM's load and unload bodies, behind the service's
admin token: the public port's runtime-updating routes stay off), and what the operator saw there written into
status.adapters.

The pod's adapters container fetches each listed adapter behind a link whose name holds a hash of its uri
(adapters.py); an adapter the pod serves from another path (its uri changed) is moved to the new one in place
(`load_inplace`: the old one serves until the new folder reads), and one whose link is not there yet (still
fetching, or failed: `kubectl logs -c adapters`) fails to load and is tried at the next pass. Passes run on a pod's
events, after a reconcile and at every resync, each on a thread of the service's own (`sync_service_soon`: a pass
waits on pods, up to a minute per adapter on a slow one, and a handler must not); while an adapter is still being
fetched, the service's pass also runs again soon, with backoff (`_plan_retry`), so a new adapter loads once it is
fetched, not at the next resync. A refused adapter (a rank above the engine's maximum, another base model's) and a
failed fetch wait for the resync: a retry would be refused again, and the adapters container retries its fetch.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import kopf

from overlap.engine.delivery.adapters import log_prefix
from overlap.engine.errors import ADAPTER_NOT_FOUND
from overlap.operator import adapters, admin_tokens, kube, status
from overlap.operator import spec as specs
from overlap.operator.identity import selector_string

MODELS_TIMEOUT_S = 5.0
FETCH_LINES = 200  # of the adapters container's log, read for the adapters that did not load
LOAD_TIMEOUT_S = 60.0  # an adapter is read from disk and moved to the device while the engine keeps serving

LOADED, NOT_LOADED = "Loaded", "NotLoaded"

# One pass per service at a time (two would load an adapter twice), apart from locks.service_lock: a pass waits on
# pods for up to a minute, and the reconcile and the control loop must not wait on it.
_PASSES: dict[str, threading.Lock] = {}
_GUARD = threading.Lock()

# A pass that leaves an adapter unloaded only because it is not fetched yet (kubelet brings a new list to the pod
# within its sync period, then the adapters container fetches it) is run again soon, with backoff, rather than at
# the next resync; one retry pending per service at most, on a timer thread: the reconcile and the control loop
# never wait on it. Past RETRY_FOR_S of waiting the resync takes over: a folder fetched without the adapter's
# config reads as one not fetched, and would be polled for ever.
RETRY_FIRST_S, RETRY_MAX_S, RETRY_FOR_S = 1.0, 15.0, 600.0
FETCH_FAILED = "; fetch: error: "  # the adapters container's last line about it is an error (_with_fetch_lines)
_RETRIES: dict[str, threading.Timer] = {}  # uid -> its pending retry
_WAITS: dict[str, tuple[frozenset[str], float, float]] = {}  # uid -> (adapters waiting, last delay, since when)
_STOPPED = threading.Event()  # the operator is stopping: no new retry, no new pass
# The handlers' passes: one worker thread per service while it has passes to run, and the newest body asked for
# since its pass began (calls while a pass runs fold into one more pass, on the newest body).
_WORKERS: set[str] = set()
_NEXT: dict[str, Mapping[str, Any]] = {}

log = logging.getLogger(__name__)


class PodAPIError(OSError):
    """The sidecar refused a call, or could not be reached; the message is its own words."""


def _call(url: str, token: str, body: Mapping[str, Any] | None, timeout_s: float) -> Any:
    data = None if body is None else json.dumps(dict(body)).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise PodAPIError(f"{exc.code}: {_error_message(exc.read().decode(errors='replace'))}") from exc
    try:
        return json.loads(text)
    except ValueError:
        return text  # vLLM answers a load or unload with a line of text


def _error_message(text: str) -> str:
    """OpenAI's error body's message (vLLM's, as {"error": {...}} or flat), else the body's start."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def served_adapters(admin_url: str, token: str) -> dict[str, str]:
    """{name: path} of the adapters a pod serves (its admin port's GET /admin/lora)."""
    served = _call(f"{admin_url}/admin/lora", token, None, MODELS_TIMEOUT_S)
    adapters = served.get("adapters") if isinstance(served, dict) else None
    if not isinstance(adapters, dict):
        raise PodAPIError(f"/admin/lora answered no adapter list: {str(served)[:200]}")
    return {str(name): str(path) for name, path in adapters.items()}


def sync_pod(admin_url: str, token: str, wanted: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Make the pod serve `wanted` ({name: path}) and no other adapter; {name: (state, message)} for each of them.
    PodAPIError (or another OSError) when its adapters cannot be read."""
    served = served_adapters(admin_url, token)
    for name in served.keys() - wanted.keys():
        # no longer listed; a refusal is tried again at the next pass
        with contextlib.suppress(PodAPIError):
            _call(f"{admin_url}/admin/lora/unload", token, {"lora_name": name}, LOAD_TIMEOUT_S)
    states = {}
    for name, path in wanted.items():
        if served.get(name) == path:
            states[name] = (LOADED, "")
            continue
        # listed from another uri: moved in place once its new folder reads, the old one serving until then (the
        # new folder arrives with the pod's next ConfigMap refresh, up to a minute later)
        body = {"lora_name": name, "lora_path": path, "load_inplace": name in served}
        try:
            _call(f"{admin_url}/admin/lora/load", token, body, LOAD_TIMEOUT_S)
            states[name] = (LOADED, "")
        except PodAPIError as exc:
            states[name] = (NOT_LOADED, str(exc))
    return states


def sync_service(owner: Mapping[str, Any]) -> None:
    """One pass over the service's ready pods, and status.adapters from what each answered."""
    with _GUARD:
        one_pass = _PASSES.setdefault(owner["metadata"]["uid"], threading.Lock())
    with one_pass:
        # planned under the pass's lock: an older pass cannot plan a retry after a newer one cancelled it
        _plan_retry(owner, _sync_service(owner))


def sync_service_soon(owner: Mapping[str, Any]) -> None:
    """sync_service on the service's worker thread; returns at once. A call while a pass runs asks for one more
    after it, on the newest body. A pass the API fails is logged; the resync's pass tries again."""
    uid = owner["metadata"]["uid"]
    with _GUARD:
        if _STOPPED.is_set():
            return
        _NEXT[uid] = copy.deepcopy(dict(owner))  # a handler's body is kopf's view of its event
        if uid in _WORKERS:
            return
        _WORKERS.add(uid)
    name = f"adapters {owner['metadata']['namespace']}/{owner['metadata']['name']}"
    threading.Thread(target=_work, args=(uid,), name=name, daemon=True).start()


def _work(uid: str) -> None:
    while True:
        with _GUARD:
            owner = _NEXT.pop(uid, None)
            if owner is None or _STOPPED.is_set():
                _WORKERS.discard(uid)
                return
        try:
            sync_service(owner)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            log.warning(f"{threading.current_thread().name}: {exc}")
        except Exception:  # the next pass (the resync's at the latest) tries again; the worker goes on
            log.exception(f"{threading.current_thread().name}: the pass failed")


def _plan_retry(owner: Mapping[str, Any], waiting: set[str]) -> None:
    """A retry of the service's pass while adapters wait for their fetch (`waiting`) and none is pending; none, and
    the backoff reset, when nothing waits (loaded, refused, or no longer listed)."""
    meta = owner["metadata"]
    uid = meta["uid"]
    with _GUARD:
        if not waiting or _STOPPED.is_set():
            _forget(uid)
            return
        names, delay, since = _WAITS.get(uid, (frozenset(), 0.0, 0.0))
        if not waiting <= names:  # a newly listed adapter: short retries again
            names, delay, since = frozenset(waiting), 0.0, time.monotonic()
        _WAITS[uid] = (names, delay, since)
        if uid in _RETRIES or time.monotonic() - since > RETRY_FOR_S:
            return  # the pending one will see what this pass saw; or the resync's turn
        delay = min(RETRY_MAX_S, 2 * delay) if delay else RETRY_FIRST_S
        timer = threading.Timer(delay, _retry, (meta["name"], meta["namespace"], uid))
        timer.daemon = True  # never holds up the operator's exit
        _RETRIES[uid], _WAITS[uid] = timer, (names, delay, since)
        timer.start()


def _retry(name: str, namespace: str, uid: str) -> None:
    """The timer's pass, on the service as it is now (its list may have changed since)."""
    with _GUARD:
        if _RETRIES.get(uid) is not threading.current_thread():
            return  # cancelled meanwhile
        del _RETRIES[uid]
    try:
        owner = kube.read_service(name, namespace)
        if owner is None or owner["metadata"].get("uid") != uid or owner["metadata"].get("deletionTimestamp"):
            forget(uid)
            return
        sync_service(owner)
    except (kopf.TemporaryError, kopf.PermanentError) as exc:  # the API failed: the resync tries again
        log.warning(f"adapters of {namespace}/{name}: {exc}")


def forget(uid: str) -> None:
    """Drop the service's pending retry and pass (it was deleted)."""
    with _GUARD:
        _forget(uid)
        _NEXT.pop(uid, None)


def _forget(uid: str) -> None:
    timer = _RETRIES.pop(uid, None)
    if timer is not None:
        timer.cancel()
    _WAITS.pop(uid, None)


def stop_retries() -> None:
    """At the operator's shutdown: pending retries cancelled, no new one planned (a pass in flight finishes)."""
    _STOPPED.set()
    with _GUARD:
        for uid in list(_RETRIES):
            _forget(uid)


def _sync_service(owner: Mapping[str, Any]) -> set[str]:
    """The pass; the adapters it left unloaded in a ready pod only because they are not fetched yet."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    spec = specs.with_defaults(owner.get("spec") or {})
    if not spec.get("adapters"):
        if (owner.get("status") or {}).get("adapters"):
            kube.patch_status(name, namespace, lambda current: {"adapters": []})
        return set()
    wanted = adapters.paths(spec)
    token, _ = admin_tokens.ensure(owner)
    seen: dict[tuple[str, str], tuple[str, str]] = {}
    for pod in kube.list_pods(namespace, selector_string(name)):
        pod_ip = (pod.get("status") or {}).get("podIP")
        if not status.pod_is_ready(pod) or not pod_ip or pod["metadata"].get("deletionTimestamp"):
            continue
        pod_name = pod["metadata"]["name"]
        try:
            states = sync_pod(f"http://{pod_ip}:{spec['sidecar']['adminPort']}", token, wanted)
        except (PodAPIError, OSError) as exc:
            states = {adapter: (NOT_LOADED, f"{pod_ip}: {exc}") for adapter in wanted}
        if any(state == NOT_LOADED for state, _ in states.values()):
            states = _with_fetch_lines(states, kube.log_tail(pod_name, namespace, adapters.CONTAINER, FETCH_LINES))
        seen.update({(adapter, pod_name): state for adapter, state in states.items()})
    when = status.now_iso()
    kube.patch_status(name, namespace, lambda current: {"adapters": adapter_status(current, seen, when)})
    return {adapter for (adapter, _), (state, message) in seen.items() if _waits_for_fetch(state, message)}


def _waits_for_fetch(state: str, message: str) -> bool:
    """Not loaded because its link is not there yet: loadable once fetched. A refusal (a rank above the engine's
    maximum, another base model's shapes) would only be refused again, and a failed fetch is retried by the adapters
    container on its own clock: both wait for the resync."""
    return state == NOT_LOADED and ADAPTER_NOT_FOUND in message and FETCH_FAILED not in message


def _with_fetch_lines(states: dict[str, tuple[str, str]], log: str | None) -> dict[str, tuple[str, str]]:
    """Each adapter not loaded with the adapters container's last line about it (fetching, or why it failed)."""
    last = {}
    for line in (log or "").splitlines():
        for name in states:
            if line.startswith(log_prefix(name)):
                last[name] = line[len(log_prefix(name)) :]
    return {name: (state, f"{message}; fetch: {last[name]}" if state == NOT_LOADED and name in last else message)
            for name, (state, message) in states.items()}  # fmt: skip


def adapter_status(owner: Mapping[str, Any], seen: Mapping[tuple[str, str], tuple[str, str]],
                   when: str) -> list[dict[str, Any]]:  # fmt: skip
    """status.adapters: an entry per (adapter, pod) seen, sorted; an unchanged entry keeps its time, so a quiet
    service's status is not rewritten at every pass."""
    before = {(e["name"], e["pod"]): e for e in (owner.get("status") or {}).get("adapters") or []}
    entries = []
    for (name, pod), (state, message) in sorted(seen.items()):
        entry = {"name": name, "pod": pod, "state": state, **({"message": message} if message else {})}
        old = before.get((name, pod))
        same = old is not None and all(old.get(k) == entry.get(k) for k in ("state", "message"))
        entries.append({**entry, "time": old["time"] if same and old.get("time") else when})
    return entries
