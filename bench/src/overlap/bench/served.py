"""A server under measurement: `overlap serve` launched and waited for, the model a server lists, the CPU its
processes used, a stop that cannot hang, and an engine config file with a few fields changed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time


async def served_model(session, url: str, flag: str, model_flag: str | None) -> str:
    """The first model the server at `url` (given as `flag`) lists at /v1/models; a clear error when it cannot be
    reached or lists none, naming `model_flag` as the way around. `overlap bench replay --target` uses it too."""
    import aiohttp

    from overlap.engine.errors import ConfigError

    hint = f"; pass {model_flag}" if model_flag else ""
    try:
        async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as response:
            status = response.status
            body = await response.json(content_type=None) if status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ConfigError(f"{flag} {url}: cannot read {url}/v1/models ({str(exc) or type(exc).__name__})") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not models:
        raise ConfigError(f"{flag} {url}: GET /v1/models answered HTTP {status} with no model{hint}")
    return models[0]["id"]


def served_model_now(url: str, flag: str, model_flag: str | None) -> str:
    import aiohttp

    async def lookup() -> str:
        async with aiohttp.ClientSession() as session:
            return await served_model(session, url, flag, model_flag)

    return asyncio.run(lookup())


def launch_serve(args, port: int):
    import subprocess
    import tempfile

    from overlap.serve import get_json

    watermarks = ["--max-queued-requests", str(max(64, args.concurrency)), "--max-inflight", str(4 * args.concurrency)]
    cmd = [sys.executable, "-m", "overlap.cli", "--log-level", "WARNING", "serve", "--port", str(port), *watermarks]
    if args.model:
        cmd += ["--model", args.model]
    if args.config:
        cmd += ["--config", args.config]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
    launched = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"overlap serve exited early: {log.read().decode(errors='replace')[-2000:]}")
        try:
            if get_json(f"{url}/readyz", timeout=1.0)[0] == 200:
                return proc, url, time.monotonic() - launched
        except OSError:
            pass
        if time.monotonic() - launched > 300:
            proc.terminate()
            raise RuntimeError("overlap serve was not ready within 300 s")
        time.sleep(0.1)


def children_cpu_s(proc) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the sidecar and engine processes under `overlap serve`."""
    from pathlib import Path

    if proc is None:
        return {}
    result = {}
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            role = "engine" if b"engine" in cmdline else "sidecar" if b"sidecar" in cmdline else None
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if role:
                result[role] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return {}  # not Linux, or a process just exited: leave the figure out
    return result


def stop(proc) -> None:
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def config_with(config_path: str | None, overrides: dict) -> str:
    """A temporary engine config file: `config_path`'s fields with `overrides` on top (read by both runs)."""
    import atexit
    import tempfile

    from overlap.engine.serving.server import read_config_file

    fields = {**(read_config_file(config_path) if config_path else {}), **overrides}
    fd, path = tempfile.mkstemp(prefix="overlap-bench-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(fields, f)
    atexit.register(os.unlink, path)
    return path
