"""Servers the tests start themselves, from Debian packages (scripts/ensure-debian-tool.sh installs what is missing:
`make test` and `make e2e` run it first, as root on CI)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ensure_tool(package: str, *commands: str) -> None:
    """Every command of `commands` on PATH, installing `package` if one is missing (CalledProcessError if that
    cannot be done here, e.g. without root)."""
    if all(shutil.which(command) for command in commands):
        return
    subprocess.run(["bash", "scripts/ensure-debian-tool.sh", package, *commands], check=True, cwd=REPO)


def ensure_prometheus() -> None:
    ensure_tool("prometheus", "prometheus", "promtool")
