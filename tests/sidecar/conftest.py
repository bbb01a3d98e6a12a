"""Fixtures for the sidecar tests; their helpers are in `tests.support.sidecar`."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def tmp_short() -> Path:
    """A short folder path (Unix socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ovl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
