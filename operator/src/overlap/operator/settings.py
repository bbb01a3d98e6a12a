"""The operator's own settings, parsed once when `overlap operator` starts, from its flags and the environment.

`OperatorSettings.from_args` reads them (a flag wins over its variable; an empty variable counts as unset) and
checks them; the CLI hands them to kopf in the memo every handler gets (`settings_of(memo)`), and `kube.configure`
takes the API timeout. Nothing reads the environment after that.

| setting | flag | environment | default |
|---|---|---|---|
| namespaces | `--namespace` (repeatable) | - | every namespace |
| prometheus_url | `--prometheus-url` | `OVERLAP_PROMETHEUS_URL` | none (a spec must name one) |
| signal_window_s | `--signal-window-s` | `OVERLAP_SIGNAL_WINDOW_S` | 60 |
| api_timeout_s | `--api-timeout-s` | `OVERLAP_API_TIMEOUT_S` | 30 |
| resync_s | `--resync-s` | `OVERLAP_RESYNC_S` | 60 |
| model_image | `--model-image` | `OVERLAP_MODEL_IMAGE` | this operator's own version's image |
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The latency signals' rate window: a minute, 4 scrapes at the ServiceMonitor's default 15 s interval.
DEFAULT_SIGNAL_WINDOW_S = 60.0
DEFAULT_API_TIMEOUT_S = 30.0
DEFAULT_RESYNC_S = 60.0

PROMETHEUS_URL_ENV = "OVERLAP_PROMETHEUS_URL"
SIGNAL_WINDOW_ENV = "OVERLAP_SIGNAL_WINDOW_S"
API_TIMEOUT_ENV = "OVERLAP_API_TIMEOUT_S"
RESYNC_ENV = "OVERLAP_RESYNC_S"
MODEL_IMAGE_ENV = "OVERLAP_MODEL_IMAGE"

MEMO_KEY = "operator_settings"  # where the settings are in kopf's memo


class SettingsError(ValueError):
    """A setting out of range or not a number; the message names its flag and variable."""


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # the watched namespaces; empty: every namespace
    prometheus_url: str = ""  # what the control loop reads when a spec names no Prometheus
    signal_window_s: float = DEFAULT_SIGNAL_WINDOW_S  # the latency signals' rate window; the tuner waits as long
    api_timeout_s: float = DEFAULT_API_TIMEOUT_S  # an API request (the operator's and kopf's) gives up after this
    resync_s: float = DEFAULT_RESYNC_S  # every service's children are put right this often
    model_image: str | None = None  # images of the services that name none; None: this operator's version's

    def __post_init__(self) -> None:
        if self.signal_window_s < 1:
            raise SettingsError(f"--signal-window-s ({SIGNAL_WINDOW_ENV}) must be >= 1, got {self.signal_window_s:g}")
        if self.api_timeout_s <= 0:
            raise SettingsError(f"--api-timeout-s ({API_TIMEOUT_ENV}) must be > 0, got {self.api_timeout_s:g}")
        if self.resync_s < 1:
            raise SettingsError(f"--resync-s ({RESYNC_ENV}) must be >= 1, got {self.resync_s:g}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> OperatorSettings:
        """From `overlap operator`'s parsed flags, each unset one from `environ` (the process's environment)."""

        def number(given: float | None, env: str, default: float) -> float:
            if given is not None:
                return given
            text = environ.get(env) or ""
            if not text:
                return default
            try:
                return float(text)
            except ValueError:
                raise SettingsError(f"{env} must be a number of seconds, got {text!r}") from None

        return cls(
            namespaces=tuple(args.namespace or ()),
            prometheus_url=args.prometheus_url or environ.get(PROMETHEUS_URL_ENV) or "",
            signal_window_s=number(args.signal_window_s, SIGNAL_WINDOW_ENV, DEFAULT_SIGNAL_WINDOW_S),
            api_timeout_s=number(args.api_timeout_s, API_TIMEOUT_ENV, DEFAULT_API_TIMEOUT_S),
            resync_s=number(args.resync_s, RESYNC_ENV, DEFAULT_RESYNC_S),
            model_image=args.model_image or environ.get(MODEL_IMAGE_ENV) or None,
        )


def settings_of(memo: Mapping[str, Any]) -> OperatorSettings:
    """The settings in a handler's kopf memo (the defaults where kopf was started without them)."""
    return memo.get(MEMO_KEY) or OperatorSettings()
