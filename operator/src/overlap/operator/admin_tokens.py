"""The sidecars' admin bearer tokens: one Secret per namespace, `overlap-admin-tokens`, one key per service.

One fixed name lets the chart grant `get`/`patch` on that Secret alone (RBAC scopes by name, never by label), so the
operator can read no other Secret in the cluster. Each service still has its own token: its pods mount only their
key. Every service in the namespace owns the Secret, so the garbage collector removes it with the last of them.
Delete the Secret to rotate every token of the namespace: the operator writes a new one at the next reconcile or
starting pod, with a fresh token for each service.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from overlap.operator import children, kube

SECRET = children.ADMIN_TOKENS_SECRET


def ensure(owner: Mapping[str, Any]) -> tuple[str, bool]:
    """This service's token, written into the namespace's Secret first if it is not there; and whether the Secret
    itself was created."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    current = kube.read("Secret", SECRET, namespace)
    if current is None:
        services = [s for s in kube.list_services(namespace) if not s["metadata"].get("deletionTimestamp")]
        if not any(s["metadata"]["uid"] == owner["metadata"]["uid"] for s in services):
            services.append(dict(owner))
        tokens = {s["metadata"]["name"]: secrets.token_urlsafe(32) for s in services}
        body = _secret(namespace, tokens, services)
        if kube.create_if_absent(body):
            return tokens[name], True
        current = kube.read("Secret", SECRET, namespace)  # created meanwhile by another handler
    data = dict((current or {}).get("data") or {})
    refs = list(current["metadata"].get("ownerReferences") or [])
    ref = _reference(owner)
    if name in data and any(r.get("uid") == ref["uid"] for r in refs):
        return base64.b64decode(data[name]).decode(), False
    token = secrets.token_urlsafe(32)  # a new service: an earlier one of the same name does not pass on its token
    stale = {r["uid"] for r in refs if r.get("name") == name}
    patch = {
        # resourceVersion: a concurrent writer's key or owner is not lost (a 409 retries the handler).
        "metadata": {
            "resourceVersion": current["metadata"]["resourceVersion"],
            "ownerReferences": [r for r in refs if r["uid"] not in stale] + [ref],
        },
        "data": {name: base64.b64encode(token.encode()).decode()},
    }
    kube.merge_patch("Secret", SECRET, namespace, patch)
    return token, False


def token_of(name: str, namespace: str) -> str | None:
    """The token the service's pods mount, or None while it is not written."""
    current = kube.read("Secret", SECRET, namespace)
    value = ((current or {}).get("data") or {}).get(name)
    return base64.b64decode(value).decode() if value else None


def _reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    # Not the controller: the Secret has several owners, and none of them controls it.
    return {**children.owner_reference(owner), "controller": False, "blockOwnerDeletion": False}


def _secret(namespace: str, tokens: Mapping[str, str], owners: list[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": SECRET,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "overlap", "app.kubernetes.io/managed-by": children.MANAGED_BY},
            "ownerReferences": [_reference(o) for o in owners],
        },
        "data": {key: base64.b64encode(token.encode()).decode() for key, token in tokens.items()},
    }
