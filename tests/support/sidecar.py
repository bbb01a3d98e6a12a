"""Helpers for the sidecar tests: real processes on free 127.0.0.1 ports, stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

FAKE_ENGINE = Path(__file__).with_name("fake_engine_server.py")
ADMIN_TOKEN = "test-admin-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None, timeout: float = 30):
    """(status, headers, parsed JSON or raw text) for any status code."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw, hdrs = response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        status, raw, hdrs = exc.code, exc.read(), exc.headers
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode(errors="replace")


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("OVERLAP_LOG", "")
    return env


class Proc:
    """A child process whose output goes to a log file; stopped by its PID."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None) -> None:
        self.cmd, self.log_path = cmd, log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or child_env())

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)

    def stop(self, timeout: float = 30) -> int:
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGUSR1)  # `overlap` dumps every thread's stack: where it hung
                time.sleep(1)
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait()
                self.log.close()
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-60:])
                raise AssertionError(
                    f"{' '.join(self.cmd[5:7])} ignored SIGTERM for {timeout:g} s; log:\n{tail}"
                ) from None
        self.log.close()
        return self.popen.returncode

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")


def wait_until(predicate, timeout: float, what: str, proc: Proc | None = None, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except OSError:
            result = None
        if result:
            return result
        if proc is not None and not proc.alive():
            raise AssertionError(f"{what}: process exited early:\n{proc.output()[-4000:]}")
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}" + (f":\n{proc.output()[-4000:]}" if proc else "")
    )


def is_ready(base_url: str) -> bool:
    return http("GET", f"{base_url}/readyz", timeout=2)[0] == 200


def overlap_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "overlap.cli", "--log-level", "INFO", *args]


@contextlib.contextmanager
def overlap_serve(
    model: Path,
    config_name: str,
    config_text: str,
    *flags: str,
    also_ready: Callable[[Proc], bool] | None = None,
    port: int | None = None,
) -> Iterator[dict]:
    """`overlap serve` of `model` as a user starts it: free public and admin ports (or the public `port` given), an
    admin token file and an engine config file (`config_name` holding `config_text`), more `flags` after them.
    Yields its url, admin url, process, model name and admin token file once /readyz (and `also_ready`) pass;
    stopped by PID and its folder removed after."""
    workdir = Path(tempfile.mkdtemp(prefix="ovl-serve-"))
    (workdir / "token").write_text(ADMIN_TOKEN)
    (workdir / config_name).write_text(config_text)
    port, admin_port = port or free_port(), free_port()
    cmd = overlap_cmd("serve", "--model", str(model), "--port", str(port), "--admin-port", str(admin_port),
                      "--admin-token-file", str(workdir / "token"), "--config", str(workdir / config_name),
                      *flags)  # fmt: skip
    proc = Proc(cmd, workdir / "serve.log")
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: is_ready(base_url) and (also_ready is None or also_ready(proc)), 300,
                   "overlap serve ready", proc)  # fmt: skip
        yield {"url": base_url, "admin": f"http://127.0.0.1:{admin_port}", "proc": proc, "model": model.name,
               "token_file": workdir / "token"}  # fmt: skip
    finally:
        proc.stop(60)
        shutil.rmtree(workdir, ignore_errors=True)


def start_fake_engine(socket_path: Path, model_dir: Path, log_path: Path, step_s: float = 0.005, *args: str) -> Proc:
    cmd = [sys.executable, str(FAKE_ENGINE), "--socket", str(socket_path), "--model-dir", str(model_dir)]
    return Proc([*cmd, "--step-s", str(step_s), *args], log_path)


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The value of one sample in Prometheus text output (`labels` like 'reason="abort"')."""
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None


class Stack:
    """An engine process (the real EngineServer around a scripted runner) and an `overlap sidecar` process."""

    def __init__(
        self,
        workdir: Path,
        model_dir: Path,
        *,
        step_s: float = 0.005,
        sidecar_args: tuple = (),
        engine_args: tuple = (),
    ) -> None:
        self.workdir, self.model_dir, self.step_s = workdir, model_dir, step_s
        self.socket = workdir / "engine.sock"
        self.port, self.admin_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.token_file = workdir / "admin-token"
        self.token_file.write_text(ADMIN_TOKEN + "\n")
        self.config_file = workdir / "engine.json"
        self.config_file.write_text("{}")
        self.sidecar_args, self.engine_args = sidecar_args, engine_args
        self.engine: Proc | None = None
        self.sidecar: Proc | None = None
        self.model = model_dir.name

    def start_engine(self) -> Proc:
        self.engine = start_fake_engine(self.socket, self.model_dir, self.workdir / "engine.log", self.step_s,
                                        *self.engine_args)  # fmt: skip
        return self.engine

    def start_sidecar(self, *extra: str, port: int | None = None, env: dict | None = None) -> Proc:
        cmd = overlap_cmd(
            "sidecar", "--engine-socket", str(self.socket), "--host", "127.0.0.1", "--port", str(port or self.port),
            "--admin-host", "127.0.0.1", "--admin-port", str(self.admin_port if port is None else free_port()),
            "--admin-token-file", str(self.token_file), "--watch-config", str(self.config_file),
            "--watch-interval-s", "0.3", "--grace-period-s", "20", "--alive-file", str(self.alive_file(port)),
            *self.sidecar_args, *extra,
        )  # fmt: skip
        proc = Proc(cmd, self.workdir / f"sidecar-{port or self.port}.log", env=env)
        if port is None:
            self.sidecar = proc
        return proc

    def alive_file(self, port: int | None = None) -> Path:
        """The --alive-file of the sidecar on `port` (default: the first one)."""
        return self.workdir / f"sidecar-{port or self.port}.alive"

    def start(self) -> Stack:
        try:
            self.start_engine()
            self.start_sidecar()
            wait_until(lambda: is_ready(self.base_url), 120, "sidecar ready", self.sidecar)
        except BaseException:
            self.stop()  # nothing left running when it never became ready
            raise
        return self

    def metrics(self) -> str:
        return http("GET", f"{self.base_url}/metrics")[2]

    def stop(self) -> None:
        for proc in (self.sidecar, self.engine):
            if proc is not None:
                proc.stop()
