"""The sidecar's one configuration object, validated at construction, and the single source of its flags.

`FLAGS` lists every command-line flag (`--max-inflight`, ...) with its `OVERLAP_*` environment variable; the
parser (`add_flags`), the config (`SidecarConfig.from_args`) and the command line `overlap serve` and the operator
hand to a sidecar (`SidecarConfig.to_argv`) are all derived from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from overlap.engine.errors import ConfigError

ENV_PREFIX = "OVERLAP_"


@dataclass(slots=True)
class SidecarConfig:
    engine_socket: str
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None  # None: no admin listener
    admin_token_file: str | None = None  # where the admin token comes from (a mounted Secret) ...
    admin_token_env: str | None = None  # ... or an environment variable naming it
    api_key_env: str | None = None  # an environment variable holding the API key for /v1/*
    watch_config: str | None = None  # an engine config file (ConfigMap mount) whose live knobs are applied on change
    # Created once listening, removed once drained and stopped: in a pod, the engine container's preStop waits for
    # it to go, so the engine outlives the sidecar's drain by no more than it must.
    alive_file: str | None = None
    watch_interval_s: float = 2.0
    served_model_name: str | None = None  # default: the engine's model folder name
    tokenizer: str | None = None  # default: the engine's model folder

    # Admission: past any of these a request gets 429 before any engine work.
    max_queued_requests: int = 64  # admitted, not yet producing tokens (field report 2's watermark)
    max_queued_tokens: int = 65536  # prompt tokens of those queued requests
    max_inflight: int = 256  # admitted and unfinished
    max_n: int = 16  # most sequences (n, best_of) one request may ask for; each counts against the watermarks
    tool_call_parser: str | None = None  # hermes | llama3_json: how tool_choice "auto" reads the model's calls
    request_timeout_s: float = 600.0  # default and upper bound; a request may only lower it
    max_body_bytes: int = 1024 * 1024
    # Slow clients: a connection without a whole request (idle, or headers trickling in) closes after idle_timeout_s;
    # a body that has not all arrived within body_timeout_s of its headers gets a 408.
    idle_timeout_s: float = 60.0
    body_timeout_s: float = 30.0
    grace_period_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    stats_interval_s: float = 0.5  # how often engine stats are polled (metrics, readiness)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter: off refuses them (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False

    # The secrets themselves, read by `from_args`; never flags, never in `to_argv`.
    admin_token: str | None = None  # bearer token for /admin/*; admin routes refuse everything when unset
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`

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
        check(self.max_n >= 1, "max_n must be >= 1")
        check(self.tool_call_parser in (None, "hermes", "llama3_json"),
              f"tool_call_parser must be hermes or llama3_json, got {self.tool_call_parser!r}")  # fmt: skip
        check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        check(self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024")
        check(self.idle_timeout_s > 0 and self.body_timeout_s > 0, "idle_timeout_s and body_timeout_s must be > 0")
        check(self.grace_period_s >= 0, "grace_period_s must be >= 0")
        check(self.stats_interval_s > 0, "stats_interval_s must be > 0")
        check(self.watch_interval_s > 0, "watch_interval_s must be > 0")
        check(self.admin_token is None or len(self.admin_token) >= 8, "the admin token must be at least 8 characters")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SidecarConfig:
        """The config of parsed flags (`add_flags`), with the secrets read from the files and variables they name."""
        values = {flag.field: getattr(args, flag.field) for flag in FLAGS}
        admin_token = read_secret(values["admin_token_file"], values["admin_token_env"], "admin token")
        if values["admin_port"] is not None and admin_token is None:
            raise ConfigError("--admin-port needs --admin-token-file or --admin-token-env")
        api_key = read_secret(None, values["api_key_env"], "API key")
        return cls(engine_socket=args.engine_socket, **values, admin_token=admin_token, api_key=api_key)

    def to_argv(self) -> list[str]:
        """The `overlap sidecar` flags that reproduce this config (secrets by reference only)."""
        argv = ["--engine-socket", self.engine_socket]
        for flag in FLAGS:
            value = getattr(self, flag.field)
            if value is not None:
                argv += [flag.name, str(value)]
        return argv

    def replace(self, **changes) -> SidecarConfig:
        return dataclasses.replace(self, **changes)


def _optional_int(text: str) -> int | None:
    return None if text == "" else int(text)


def _bool(text: str) -> bool:
    if isinstance(text, bool):
        return text
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return text.lower() in ("true", "1")


@dataclass(frozen=True, slots=True)
class Flag:
    field: str  # the SidecarConfig field it sets
    type: object  # what argparse converts the text with
    help: str
    env_name: str | None = None  # the environment variable, where vLLM's name is kept (default OVERLAP_<FIELD>)

    @property
    def name(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return self.env_name or ENV_PREFIX + self.field.upper()


FLAGS = (
    Flag("host", str, "address of the public API"),
    Flag("port", int, "public API port"),
    Flag("admin_host", str, "address of the admin API"),
    Flag("admin_port", _optional_int, "admin API port for GET/PUT /admin/config; needs an admin token"),
    Flag("admin_token_file", str, "file holding the admin bearer token (a mounted Secret)"),
    Flag("admin_token_env", str, "name of an environment variable holding the admin bearer token"),
    Flag("api_key_env", str, "name of an environment variable holding an API key required on /v1/* (off by default)"),
    Flag("served_model_name", str, "model name clients use (default: the model folder's name)"),
    Flag("tokenizer", str, "tokenizer folder (default: the engine's model folder)"),
    Flag("max_queued_requests", int, "admission watermark: requests admitted but not started"),
    Flag("max_queued_tokens", int, "admission watermark: prompt tokens of queued requests"),
    Flag("max_inflight", int, "admission cap on unfinished requests"),
    Flag("max_n", int, "most sequences (n, best_of) per request"),
    Flag("tool_call_parser", str, "hermes | llama3_json: how tool_choice auto reads tool calls (default: none)"),
    Flag("request_timeout_s", float, "per-request timeout; a request may only lower it"),
    Flag("max_body_bytes", int, "largest request body accepted, in bytes"),
    Flag("idle_timeout_s", float, "a connection without a whole request (idle, or slow headers) closes after this"),
    Flag("body_timeout_s", float, "a request body not all arrived this long after its headers gets a 408"),
    Flag("grace_period_s", float, "on SIGTERM, how long in-flight requests may take to finish"),
    Flag("watch_config", str, "engine config file (ConfigMap mount) whose live knobs are applied when it changes"),
    Flag("watch_interval_s", float, "how often the watched config file is checked"),
    Flag("alive_file", str, "a file that exists from start-up until the sidecar has drained and stopped"),
    Flag("allow_runtime_lora_updating", _bool,
         "true: POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the engine's LoRA adapters",
         env_name="VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
)  # fmt: skip
_FIELDS = {f.name: f for f in dataclasses.fields(SidecarConfig)}
assert all(flag.field in _FIELDS for flag in FLAGS), "every flag sets a SidecarConfig field"


def add_flags(parser: argparse.ArgumentParser, *, listen_on_all: bool = False) -> None:
    """The sidecar's flags, each defaulting to its `OVERLAP_*` variable, else to SidecarConfig's default. In a
    container (`listen_on_all`) the two listeners default to every address."""
    for flag in FLAGS:
        default = _FIELDS[flag.field].default
        if listen_on_all and flag.field in ("host", "admin_host"):
            default = "0.0.0.0"
        env = os.environ.get(flag.env)
        shown = "" if default is None else f"; default {default}"
        # argparse converts a text default with `type` like a given flag, so a bad variable is a usage error.
        parser.add_argument(flag.name, type=flag.type, default=default if env is None else env,
                            help=f"{flag.help} ({flag.env}{shown})")  # fmt: skip


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
