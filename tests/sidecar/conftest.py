"""Sidecar tests import their helpers from `sidecar_helpers.py` next to this file."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Only this test folder goes on sys.path (never the repo root: its operator/ folder shadows the stdlib).
_here = str(Path(__file__).parent)
if _here not in sys.path:
    sys.path.insert(0, _here)


@pytest.fixture
def tmp_short() -> Path:
    """A short folder path (Unix socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ovl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
