"""`overlap sidecar`: the pod's HTTP container."""

from __future__ import annotations

import argparse
import os

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


def _run_sidecar(args: argparse.Namespace) -> int:
    import uvloop

    from overlap.sidecar.app import serve

    # uvloop, as vLLM's server runs on: the sidecar's CPU per request is mostly event-loop work (a socket read, a
    # wake-up and an SSE write per streamed token).
    uvloop.run(serve(SidecarConfig.from_args(args)))
    return 0
