"""`overlap sidecar` (the pod's HTTP container) and `overlap serve` (engine + sidecar as two processes)."""

from __future__ import annotations

import argparse
import os


def _env(name: str, default=None):
    return os.environ.get(f"OVERLAP_{name}", default)


def add_sidecar_flags(parser: argparse.ArgumentParser, *, for_serve: bool = False) -> None:
    """Flags shared by `overlap sidecar` and `overlap serve` (each has an OVERLAP_* environment equivalent)."""
    parser.add_argument(
        "--host",
        default=_env("HOST", "127.0.0.1" if for_serve else "0.0.0.0"),
        help="address of the public API (OVERLAP_HOST)",
    )
    parser.add_argument("--port", type=int, default=int(_env("PORT", "8000")), help="public API port (OVERLAP_PORT)")
    parser.add_argument(
        "--admin-host",
        default=_env("ADMIN_HOST", "127.0.0.1" if for_serve else "0.0.0.0"),
        help="address of the admin API (OVERLAP_ADMIN_HOST)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        default=_int_or_none(_env("ADMIN_PORT")),
        help="admin API port for GET/PUT /admin/config; needs an admin token (OVERLAP_ADMIN_PORT)",
    )
    parser.add_argument(
        "--admin-token-file",
        default=_env("ADMIN_TOKEN_FILE"),
        help="file holding the admin bearer token (a mounted Secret)",
    )
    parser.add_argument(
        "--admin-token-env",
        default=_env("ADMIN_TOKEN_ENV"),
        help="name of an environment variable holding the admin bearer token",
    )
    parser.add_argument(
        "--api-key-env",
        default=_env("API_KEY_ENV"),
        help="name of an environment variable holding an API key required on /v1/* (off by default)",
    )
    parser.add_argument(
        "--served-model-name",
        default=_env("SERVED_MODEL_NAME"),
        help="model name clients use (default: the model folder's name)",
    )
    parser.add_argument(
        "--tokenizer", default=_env("TOKENIZER"), help="tokenizer folder (default: the engine's model folder)"
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=int(_env("MAX_QUEUED_REQUESTS", "64")),
        help="admission watermark: requests admitted but not started (default 64)",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=int(_env("MAX_QUEUED_TOKENS", "65536")),
        help="admission watermark: prompt tokens of queued requests (default 65536)",
    )
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=int(_env("MAX_INFLIGHT", "256")),
        help="admission cap on unfinished requests (default 256)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=float(_env("REQUEST_TIMEOUT_S", "600")),
        help="per-request timeout; a request may only lower it (default 600)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(_env("MAX_BODY_BYTES", str(1024 * 1024))),
        help="largest request body accepted (default 1 MiB)",
    )
    parser.add_argument(
        "--grace-period-s",
        type=float,
        default=float(_env("GRACE_PERIOD_S", "30")),
        help="on SIGTERM, how long in-flight requests may take to finish (default 30)",
    )
    parser.add_argument(
        "--watch-config",
        default=_env("WATCH_CONFIG"),
        help="engine config file (ConfigMap mount) whose live knobs are applied when it changes",
    )
    parser.add_argument("--watch-interval-s", type=float, default=float(_env("WATCH_INTERVAL_S", "2")),
                        help="how often the watched config file is checked (default 2)")  # fmt: skip


def _int_or_none(value):
    return None if value in (None, "") else int(value)


def register(subparsers) -> None:
    sidecar = subparsers.add_parser(
        "sidecar", help="run the HTTP sidecar (OpenAI API, admission, metrics, live config) in front of an engine"
    )
    sidecar.add_argument("--engine-socket", default=_env("ENGINE_SOCKET"), required=_env("ENGINE_SOCKET") is None,
                         help="the engine's Unix socket (OVERLAP_ENGINE_SOCKET)")  # fmt: skip
    add_sidecar_flags(sidecar)
    sidecar.set_defaults(func=_run_sidecar)

    serve = subparsers.add_parser(
        "serve", help="run an engine and its sidecar as two processes (one pod's worth, no cluster); Ctrl-C stops both"
    )
    serve.add_argument("--model", help="local Hugging Face model folder (default: the tiny default model)")
    serve.add_argument("--config", help="engine config file (JSON or YAML of EngineConfig fields)")
    serve.add_argument("--ready-timeout-s", type=float, default=600.0, help="give up when not ready after this long")
    add_sidecar_flags(serve, for_serve=True)
    serve.set_defaults(func=_run_serve)


def sidecar_config_from_args(args: argparse.Namespace):
    from overlap.engine.errors import ConfigError
    from overlap.sidecar.config import SidecarConfig, read_secret

    admin_token = read_secret(args.admin_token_file, args.admin_token_env, "admin token")
    if args.admin_port is not None and admin_token is None:
        raise ConfigError("--admin-port needs --admin-token-file or --admin-token-env")
    return SidecarConfig(
        engine_socket=args.engine_socket,
        host=args.host,
        port=args.port,
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        admin_token=admin_token,
        watch_config=args.watch_config,
        watch_interval_s=args.watch_interval_s,
        api_key=read_secret(None, args.api_key_env, "API key"),
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_inflight=args.max_inflight,
        request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes,
        grace_period_s=args.grace_period_s,
    )


def _run_sidecar(args: argparse.Namespace) -> int:
    import asyncio

    from overlap.sidecar.app import serve

    asyncio.run(serve(sidecar_config_from_args(args)))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from overlap.sidecar.serve import run_serve

    return run_serve(args)
