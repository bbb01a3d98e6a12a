"""The API server's error object (`kind: Status`), as kmock renders it."""

from __future__ import annotations

import kmock


def api_status(code: int, reason: str, message: str, details: dict | None = None) -> kmock.KubernetesError:
    # Non-empty details: kmock would put a Python traceback there otherwise.
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {"causes": []})
