"""`overlap serve`: one pod's worth on a laptop. Starts `overlap engine` and `overlap sidecar` as two real processes
joined by a Unix socket in a private temporary folder, waits until the API is ready, prints a `curl` line, restarts
the engine if it dies (as a pod would; the sidecar reconnects), and on Ctrl-C/SIGTERM drains the sidecar, then
stops the engine.

It is no part of a pod (there the kubelet starts the two containers), so it is a package of its own beside
`overlap.sidecar`; it ships in the sidecar's distribution because it takes the sidecar's flags, and its extra
`overlap-sidecar[serve]` brings the engine's model stack."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from overlap.engine.config import add_engine_flags
from overlap.sidecar.config import add_flags, read_secret

_MAX_QUICK_RESTARTS = 3  # engine deaths within _QUICK_S of its start before giving up
_QUICK_S = 30.0


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="run an engine and its sidecar as two processes (one pod's worth, no cluster); Ctrl-C stops both"
    )
    serve.add_argument("--model", help="local Hugging Face model folder (default: the tiny default model)")
    serve.add_argument("--config", help="engine config file (JSON or YAML of EngineConfig fields)")
    serve.add_argument("--ready-timeout-s", type=float, default=600.0, help="give up when not ready after this long")
    add_flags(serve)
    add_engine_flags(serve)
    serve.set_defaults(func=run_serve)


def _say(message: str) -> None:
    print(f"overlap serve: {message}", file=sys.stderr, flush=True)


def get_json(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}


def _stop(proc: subprocess.Popen | None, timeout: float, name: str) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _say(f"{name} did not stop within {timeout:.0f} s; killing it")
        proc.kill()
        proc.wait()


def run_serve(args: argparse.Namespace) -> int:
    from overlap.engine.config import EngineConfig, engine_argv, engine_overrides
    from overlap.sidecar.config import SidecarConfig

    args.engine_socket = "unused"
    config = SidecarConfig.from_args(args)  # bad flags fail here, before anything starts
    EngineConfig().replace(**engine_overrides(args))  # and so do bad engine flags

    if not args.model:  # build it once here, so the sidecar can load its tokenizer while the engine loads
        from overlap.engine.model.builder import ensure_default_model

        args.model = str(ensure_default_model())
    args.tokenizer = args.tokenizer or args.model
    tmp = tempfile.mkdtemp(prefix="overlap-serve-")
    socket_path = os.path.join(tmp, "engine.sock")
    base = [sys.executable, "-m", "overlap.cli", "--log-level", args.log_level]
    engine_cmd = [*base, "engine", "--socket", socket_path]
    if args.config:
        engine_cmd += ["--config", args.config]
    if args.model:
        engine_cmd += ["--model", args.model]
    engine_cmd += engine_argv(args)
    # edit the config file and its live knobs apply
    config = config.replace(
        engine_socket=socket_path, tokenizer=args.tokenizer, watch_config=args.watch_config or args.config
    )
    sidecar_cmd = [*base, "sidecar", *config.to_argv()]
    env = {**os.environ, "OVERLAP_GRACE_PERIOD_S": str(args.grace_period_s)}

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    # Own sessions: a terminal's Ctrl-C reaches only this supervisor, which then stops the children in order.
    def start(cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    engine = sidecar = None
    try:
        launched = time.monotonic()
        engine = start(engine_cmd)
        engine_started = launched
        sidecar = start(sidecar_cmd)
        _say(f"engine pid {engine.pid}, sidecar pid {sidecar.pid}; waiting until ready (model load takes a moment)")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        url = f"http://{host}:{args.port}"
        ready = _wait_ready(url, [engine, sidecar], stop, args.ready_timeout_s)
        if not ready:
            return 0 if stop.is_set() else 1
        _print_ready(url, args, time.monotonic() - launched)

        quick_deaths = 0
        while not stop.wait(0.5):
            if sidecar.poll() is not None:
                _say(f"the sidecar exited with status {sidecar.returncode}; stopping")
                return 1
            if engine.poll() is not None:
                quick_deaths = quick_deaths + 1 if time.monotonic() - engine_started < _QUICK_S else 1
                if quick_deaths > _MAX_QUICK_RESTARTS:
                    _say("the engine keeps dying right after start; giving up")
                    return 1
                _say(f"the engine exited with status {engine.returncode}; restarting it (the sidecar reconnects)")
                engine, engine_started = start(engine_cmd), time.monotonic()
        _say("stopping: draining the sidecar, then the engine")
        return 0
    finally:
        _stop(sidecar, args.grace_period_s + 10, "the sidecar")
        _stop(engine, 15, "the engine")
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_ready(url: str, procs: list[subprocess.Popen], stop: threading.Event, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    next_note = time.monotonic() + 10
    while not stop.is_set():
        for proc in procs:
            if proc.poll() is not None:
                _say(f"process {proc.pid} exited with status {proc.returncode} before the server was ready")
                return False
        try:
            status, body = get_json(f"{url}/readyz", timeout=1.0)
            if status == 200:
                return True
            state = body
        except (OSError, ValueError) as exc:
            state = f"not listening yet ({getattr(exc, 'reason', exc)})"
        now = time.monotonic()
        if now >= deadline:
            _say(f"not ready after {timeout_s:.0f} s (last state: {state}); stopping")
            return False
        if now >= next_note:
            _say(f"still starting: {state}")
            next_note = now + 10
        stop.wait(0.2)
    return False


def _print_ready(url: str, args: argparse.Namespace, elapsed: float) -> None:
    key = read_secret(None, args.api_key_env, "API key")  # the sidecar read it already: set and not empty
    _, models = get_json(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else None)
    model = models["data"][0]["id"] if models.get("data") else "default"
    body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 16})
    auth = f' -H "Authorization: Bearer ${args.api_key_env}"' if args.api_key_env else ""
    print(f"Overlap is ready on {url} (model {model}, {elapsed:.1f} s after launch). Try:", flush=True)
    print(
        f"  curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}", flush=True
    )
    print("Ctrl-C stops the server.", flush=True)
