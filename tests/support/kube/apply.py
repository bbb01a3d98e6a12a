"""Server-side apply and field ownership, as much of the API server's structured-merge-diff as the tests need.

Every write records which manager set which fields in `metadata.managedFields` (FieldsV1, the server's format).
An apply (`PATCH`, `application/apply-patch+yaml`) then:
- refuses with 409 a field another manager owns at a different value, unless `force=true` takes it over;
- removes the fields this manager applied before and no longer applies, unless another manager owns them too;
- merges the rest: maps by key, lists of named things (containers, env, volumes, ports ...) by their key,
  other lists whole.

Left out: the schema's own list types (a fixed table stands in), defaulting and quantity normalisation before
comparing, and per-subresource managers (status writes are not tracked).
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Mapping
from typing import Any

from tests.support.kube.status import api_status

APPLY_PATCH = "application/apply-patch+yaml"
# Lists merged item by item, by these key fields (kube's `listType=map` + `listMapKey`); the rest are atomic.
# Ports take whichever of the two their kind uses.
KEYED_LISTS = {
    "containers": ("name",), "initContainers": ("name",), "env": ("name",), "volumes": ("name",),
    "imagePullSecrets": ("name",), "volumeMounts": ("mountPath",), "ownerReferences": ("uid",),
    "ports": ("containerPort", "port"),
}  # fmt: skip
TRACKED_METADATA = ("labels", "annotations", "ownerReferences", "finalizers")
_MISSING = object()
Path = tuple[str, ...]


def manager_of(params: Mapping[str, str], headers: Mapping[str, str]) -> str:
    """`?fieldManager=`, else the User-Agent up to its first '/', as the API server does."""
    return params.get("fieldManager") or headers.get("User-Agent", "unknown").split("/")[0] or "unknown"


def record_update(before: dict | None, after: dict, manager: str) -> None:
    """A create, update or patch: `manager` now owns what it changed; nobody owns what it removed."""
    old = _leaves(_tracked(before)) if before else {}
    new = _leaves(_tracked(after))
    changed = {path for path, value in new.items() if old.get(path, _MISSING) != value}
    entries = _entries(before)
    for entry in entries.values():
        entry["fields"] -= changed | (old.keys() - new.keys())
    if changed:
        entry = entries.setdefault((manager, "Update"), {"fields": set()})
        entry["fields"] |= changed
        entry["touched"] = True
    _store_entries(after, entries, before)


def server_side_apply(live: dict | None, applied: dict, manager: str, force: bool) -> dict:
    """The object after `manager` applies `applied` to `live` (None: it does not exist yet)."""
    applied_leaves = _leaves(_tracked(applied))
    entries = _entries(live)
    current = live or {}
    conflicts = []
    for (other, operation), entry in entries.items():
        if other == manager and operation == "Apply":
            continue
        for path in sorted(entry["fields"] & applied_leaves.keys()):
            if _get(current, path) != applied_leaves[path]:
                conflicts.append((other, path))
    if conflicts and not force:
        listed = "\n".join(f'- conflict with "{other}": {_dotted(path)}' for other, path in conflicts)
        raise api_status(409, "Conflict", f"Apply failed with {len(conflicts)} conflict(s):\n{listed}")
    for other, path in conflicts:
        for (name, _), entry in entries.items():
            if name == other:
                entry["fields"].discard(path)

    mine = entries.get((manager, "Apply"), {"fields": set()})["fields"]
    others = set().union(*(e["fields"] for k, e in entries.items() if k != (manager, "Apply")))
    stale = mine - applied_leaves.keys() - others
    result = _merged(_without(copy.deepcopy(current), stale), copy.deepcopy(applied))
    result = result if isinstance(result, dict) else {}
    touched = set(applied_leaves) != mine or _tracked(result) != _tracked(current)
    entries[(manager, "Apply")] = {
        **entries.get((manager, "Apply"), {}),
        "fields": set(applied_leaves),
        "touched": touched,
    }
    _store_entries(result, entries, live)
    return result


# --- field paths --------------------------------------------------------------------------------------------------
# A path is a tuple of FieldsV1 keys: "f:name" for a map key, 'k:{"name":"engine"}' for an item of a keyed list.


def _tracked(obj: Mapping[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k in TRACKED_METADATA}
    return {**body, **({"metadata": meta} if meta else {})}


def _item_key(field: str, item: Any) -> str | None:
    if field not in KEYED_LISTS or not isinstance(item, dict):
        return None
    names = KEYED_LISTS[field]
    present = [n for n in names if n in item][:1] if field == "ports" else list(names)
    if not present or any(n not in item for n in present):
        return None
    return "k:" + json.dumps({n: item[n] for n in present}, separators=(",", ":"), sort_keys=True)


def _is_keyed(field: str, value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_item_key(field, item) for item in value)


def _leaves(value: Any, path: Path = ()) -> dict[Path, Any]:
    """Every field set in `value`, by path: scalars, empty maps and atomic lists are leaves."""
    if not isinstance(value, dict) or not value:
        return {path: value}
    out: dict[Path, Any] = {}
    for key, child in value.items():
        child_path = (*path, f"f:{key}")
        if _is_keyed(key, child):
            for item in child:
                out.update(_leaves(item, (*child_path, _item_key(key, item))))
        else:
            out.update(_leaves(child, child_path))
    return out


def _get(value: Any, path: Path) -> Any:
    for step in path:
        if step.startswith("f:") and isinstance(value, dict) and step[2:] in value:
            field, value = step[2:], value[step[2:]]
        elif step.startswith("k:") and isinstance(value, list):
            value = next((item for item in value if _item_key(field, item) == step), _MISSING)
        else:
            return _MISSING
    return value


def _without(value: Any, removed: set[Path], path: Path = ()) -> Any:
    """`value` less the fields in `removed`; a map or list item left empty by that goes too."""
    if path in removed:
        return _MISSING
    if not isinstance(value, dict) or not any(r[: len(path)] == path and len(r) > len(path) for r in removed):
        return value
    out = {}
    for key, child in value.items():
        child_path = (*path, f"f:{key}")
        if _is_keyed(key, child):
            items = [_without(item, removed, (*child_path, _item_key(key, item))) for item in child]
            kept = [item for item in items if item is not _MISSING]
            if kept:
                out[key] = kept
        elif (kept := _without(child, removed, child_path)) is not _MISSING:
            out[key] = kept
    return out or _MISSING


def _merged(live: Any, applied: Any, field: str = "") -> Any:
    if isinstance(live, dict) and isinstance(applied, dict):
        return {**live, **{k: _merged(live.get(k, _MISSING), v, k) for k, v in applied.items()}}
    if _is_keyed(field, applied) and (_is_keyed(field, live) or live == []):
        wanted = {_item_key(field, item): item for item in applied}
        out = [_merged(item, wanted.pop(_item_key(field, item), _MISSING), field) for item in live]
        return [item for item in out if item is not _MISSING] + list(wanted.values())
    return live if applied is _MISSING else applied


def _dotted(path: Path) -> str:
    return "".join(f".{step[2:]}" if step.startswith("f:") else f"[{step[2:]}]" for step in path)


# --- metadata.managedFields ---------------------------------------------------------------------------------------


def _entries(obj: Mapping[str, Any] | None) -> dict[tuple[str, str], dict[str, Any]]:
    entries = {}
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        fields = set(_paths(entry.get("fieldsV1") or {}))
        entries[(entry["manager"], entry["operation"])] = {"fields": fields, "entry": entry}
    return entries


def _store_entries(obj: dict, entries: dict[tuple[str, str], dict[str, Any]], before: Mapping | None) -> None:
    """Write `entries` to obj's managedFields; an entry whose fields did not change keeps its time, so a no-op write
    stays a no-op."""
    now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    api_version = obj.get("apiVersion") or (before or {}).get("apiVersion", "")
    out = []
    for (manager, operation), entry in entries.items():
        if not entry["fields"]:
            continue
        previous = entry.get("entry")
        if previous is not None and not entry.get("touched") and _fields_v1(entry["fields"]) == previous["fieldsV1"]:
            out.append(previous)
            continue
        out.append({"manager": manager, "operation": operation, "apiVersion": api_version, "time": now,
                    "fieldsType": "FieldsV1", "fieldsV1": _fields_v1(entry["fields"])})  # fmt: skip
    obj.setdefault("metadata", {})["managedFields"] = out


def _paths(tree: Mapping[str, Any], path: Path = ()) -> list[Path]:
    if not tree:
        return [path] if path else []
    return [p for step, child in tree.items() for p in _paths(child, (*path, step))]


def _fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for step in path:
            node = node.setdefault(step, {})
    return tree
