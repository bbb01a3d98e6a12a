"""One writer per InferenceService at a time, across the operator's threads (kopf runs sync handlers in a pool): the
reconcile, the restore of a child, the periodic resync and the control loop's tick each plan from the service as
they read it, so two at once could write a plan made from an older status over a newer one (a retune undone)."""

from __future__ import annotations

import threading

_LOCKS: dict[str, threading.RLock] = {}
_GUARD = threading.Lock()


def service_lock(uid: str) -> threading.RLock:
    """The lock of the service with this uid (re-entrant: a tick that reconciles takes it twice)."""
    with _GUARD:
        return _LOCKS.setdefault(uid, threading.RLock())
