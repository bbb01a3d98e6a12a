"""Whether a live object still holds what the operator wrote: fields the server adds do not count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_subset(desired: Any, actual: Any) -> bool:
    """Whether every field of `desired` has the same value in `actual` (which may hold more: server defaults).

    Drift detection: a child edited by hand fails this and is put back.
    """
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and is_subset(value, actual[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return desired == actual or _same_quantity(desired, actual)


def _same_quantity(desired: Any, actual: Any) -> bool:
    """ "0.5" and "500m", "1Gi" and "1073741824": the API server stores quantities in canonical form."""
    if not (isinstance(desired, str) and isinstance(actual, str)):
        return False
    from kubernetes.utils.quantity import parse_quantity

    try:
        return parse_quantity(desired) == parse_quantity(actual)
    except ValueError:
        return False
