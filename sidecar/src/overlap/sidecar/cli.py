"""`overlap sidecar` (the pod's HTTP container) and `overlap serve` (engine + sidecar as two processes)."""

from __future__ import annotations

import argparse
import os

from overlap.engine.config import add_engine_flags
from overlap.sidecar.config import ENV_PREFIX, SidecarConfig, add_flags


def register(subparsers) -> None:
    sidecar = subparsers.add_parser(
        "sidecar", help="run the HTTP sidecar (OpenAI API, admission, metrics, live config) in front of an engine"
    )
    socket_env = os.environ.get(f"{ENV_PREFIX}ENGINE_SOCKET")
    sidecar.add_argument("--engine-socket", default=socket_env, required=socket_env is None,
                         help=f"the engine's Unix socket ({ENV_PREFIX}ENGINE_SOCKET)")  # fmt: skip
    add_flags(sidecar, listen_on_all=True)
    sidecar.set_defaults(func=_run_sidecar)

    serve = subparsers.add_parser(
        "serve", help="run an engine and its sidecar as two processes (one pod's worth, no cluster); Ctrl-C stops both"
    )
    serve.add_argument("--model", help="local Hugging Face model folder (default: the tiny default model)")
    serve.add_argument("--config", help="engine config file (JSON or YAML of EngineConfig fields)")
    serve.add_argument("--ready-timeout-s", type=float, default=600.0, help="give up when not ready after this long")
    add_flags(serve)
    add_engine_flags(serve)
    serve.set_defaults(func=_run_serve)

    from overlap.sidecar import activator
    from overlap.sidecar.router import app as router

    activator.add_parser(subparsers)
    router.add_parser(subparsers)


def _run_sidecar(args: argparse.Namespace) -> int:
    import uvloop

    from overlap.sidecar.app import serve

    # uvloop, as vLLM's server runs on: the sidecar's CPU per request is mostly event-loop work (a socket read, a
    # wake-up and an SSE write per streamed token).
    uvloop.run(serve(SidecarConfig.from_args(args)))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from overlap.sidecar.serve import run_serve

    return run_serve(args)
