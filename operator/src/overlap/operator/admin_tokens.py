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

import kopf

from overlap.operator import kube
from overlap.operator.identity import ADMIN_TOKENS_SECRET, OWNED, owner_reference

SECRET = ADMIN_TOKENS_SECRET


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
        if current is None:
            raise kopf.TemporaryError(f"Secret {namespace}/{SECRET} came and went; retrying", delay=1)
    data = dict(current.get("data") or {})
    refs = list(current["metadata"].get("ownerReferences") or [])
    ref = _reference(owner)
    if name in data and any(r.get("uid") == ref["uid"] for r in refs):
        return base64.b64decode(data[name]).decode(), False
    token = secrets.token_urlsafe(32)  # a new service: an earlier one of the same name does not pass on its token
    # A JSON patch appends on the server: services added at once never overwrite each other's key or reference.
    # An earlier service's reference under the same name dangles; the garbage collector drops it.
    add_ref = {"op": "add", "path": "/metadata/ownerReferences/-" if refs else "/metadata/ownerReferences",
               "value": ref if refs else [ref]}  # fmt: skip
    add_key = {"op": "add", "path": f"/data/{name}", "value": base64.b64encode(token.encode()).decode()}
    kube.json_patch("Secret", SECRET, namespace, [add_key, add_ref] if "data" in current else
                    [{"op": "add", "path": "/data", "value": {}}, add_key, add_ref])  # fmt: skip
    return token, False


def _reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    # Not the controller: the Secret has several owners, and none of them controls it.
    return {**owner_reference(owner), "controller": False, "blockOwnerDeletion": False}


def _secret(namespace: str, tokens: Mapping[str, str], owners: list[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": SECRET,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "overlap", **OWNED},
            "ownerReferences": [_reference(o) for o in owners],
        },
        "data": {key: base64.b64encode(token.encode()).decode() for key, token in tokens.items()},
    }
