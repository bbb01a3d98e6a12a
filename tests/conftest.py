"""Fixtures shared by every test folder."""

from __future__ import annotations

from pathlib import Path

import pytest

import overlap.engine  # noqa: F401  (first: sets OpenMP's wait policy before any test module loads torch)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny default model's folder, built once into the cache (`$OVERLAP_CACHE_DIR`, default ~/.cache/overlap)."""
    from overlap.engine.model.builder import ensure_default_model

    return ensure_default_model()


@pytest.fixture
def reliability(request: pytest.FixtureRequest):
    """The row a reliability scenario records (tests/support/reliability.py; `make reliability` collects them)."""
    from tests.support.reliability import Recorder

    marker = next((m for m in ("e2e", "long") if request.node.get_closest_marker(m)), None)
    return Recorder(request.node.nodeid, marker)
