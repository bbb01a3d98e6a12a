"""The sidecar's one configuration object, validated at construction (flags and `OVERLAP_*` env fill it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from overlap.engine.errors import ConfigError


@dataclass(slots=True)
class SidecarConfig:
    engine_socket: str
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None  # None: no admin listener
    admin_token: str | None = None  # bearer token for /admin/*; admin routes refuse everything when unset
    watch_config: str | None = None  # an engine config file (ConfigMap mount) whose live knobs are applied on change
    watch_interval_s: float = 2.0
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    served_model_name: str | None = None  # default: the engine's model folder name
    tokenizer: str | None = None  # default: the engine's model folder

    # Admission: past any of these a request gets 429 before any engine work.
    max_queued_requests: int = 64  # admitted, not yet producing tokens (field report 2's watermark)
    max_queued_tokens: int = 65536  # prompt tokens of those queued requests
    max_inflight: int = 256  # admitted and unfinished
    request_timeout_s: float = 600.0  # default and upper bound; a request may only lower it
    max_body_bytes: int = 1024 * 1024
    grace_period_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    stats_interval_s: float = 0.5  # how often engine stats are polled (metrics, readiness)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        check(bool(self.engine_socket), "engine_socket is required")
        check(0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}")
        check(self.admin_port is None or 0 <= self.admin_port < 65536, "admin_port must be in 0..65535")
        check(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        check(self.max_queued_tokens >= 1, "max_queued_tokens must be >= 1")
        check(self.max_inflight >= 1, "max_inflight must be >= 1")
        check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        check(self.grace_period_s >= 0, "grace_period_s must be >= 0")
        check(self.stats_interval_s > 0, "stats_interval_s must be > 0")
        check(self.watch_interval_s > 0, "watch_interval_s must be > 0")
        check(self.admin_token is None or len(self.admin_token) >= 8, "the admin token must be at least 8 characters")


def read_secret(file_path: str | None, env_name: str | None, what: str) -> str | None:
    """A secret from a file (Kubernetes Secret mount) or an environment variable; None when neither is given."""
    if file_path:
        try:
            value = Path(file_path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the {what} file {file_path}: {exc}") from exc
        if not value:
            raise ConfigError(f"the {what} file {file_path} is empty")
        return value
    if env_name:
        value = os.environ.get(env_name, "").strip()
        if not value:
            raise ConfigError(f"the {what} environment variable {env_name} is unset or empty")
        return value
    return None
