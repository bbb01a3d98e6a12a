"""How a real API server picks objects: label selectors, field selectors, and the JSONPath subset that CRD printer
columns and scale subresource paths use."""

from __future__ import annotations

import re
from typing import Any


def match_labels(labels: dict[str, str], selector: str) -> bool:
    """A label selector string: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`."""
    for term in re.findall(r"[^,(]+(?:\([^)]*\))?", selector or ""):
        term = term.strip()
        if not term:
            continue
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            values = {v.strip() for v in m[3].split(",")}
            inside = labels.get(m[1]) in values
            if inside != (m[2] == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = re.split(r"==?", term, maxsplit=1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def match_fields(obj: dict, selector: str) -> bool:
    """Field selectors on metadata.name / metadata.namespace (what kubectl and kopf use)."""
    for term in filter(None, (selector or "").split(",")):
        negate = "!=" in term
        key, value = re.split(r"!=|==?", term, maxsplit=1)
        actual = obj.get("metadata", {}).get(key.strip().removeprefix("metadata."))
        if (actual == value.strip()) == negate:
            return False
    return True


def jsonpath(obj: Any, path: str) -> Any:
    """The JSONPath subset CRD printer columns use: `.a.b` and `.list[?(@.key=="value")].field`."""
    current = [obj]
    for step in re.findall(r"\.([A-Za-z0-9_-]+)|\[\?\(@\.(\w+)==\"([^\"]*)\"\)\]", path):
        name, key, value = step
        if name:
            current = [c[name] for c in current if isinstance(c, dict) and name in c]
        else:
            current = [
                i for c in current if isinstance(c, list) for i in c if isinstance(i, dict) and i.get(key) == value
            ]
    return current[0] if current else None
