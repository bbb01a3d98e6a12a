"""The API key of the OpenAI API: `Authorization: Bearer KEY` on every `/v1/` path, checked the same way by the pod's
sidecar and by the proxies in front of it (the router and the activator, which hold requests and must not hold a
stranger's)."""

from __future__ import annotations

import hmac

GUARDED_PREFIX = "/v1/"
UNAUTHORIZED = {
    "error": {"message": "a valid API key is required (Authorization: Bearer KEY)", "type": "authentication_error",
              "param": None, "code": "invalid_api_key"}
}  # fmt: skip


def bearer_matches(authorization: str, secret: str) -> bool:
    """`Authorization: Bearer <secret>`, compared in constant time (on bytes: any header text is safe)."""
    scheme, _, given = authorization.partition(" ")
    given_bytes = given.strip().encode("utf-8", errors="replace")
    return hmac.compare_digest(given_bytes, secret.encode()) and scheme.lower() == "bearer"


def needs_key(path: str, authorization: str, key: str | None) -> bool:
    """Whether a request to `path` with this Authorization header must be refused (401) where `key` guards the API."""
    return key is not None and path.startswith(GUARDED_PREFIX) and not bearer_matches(authorization, key)
