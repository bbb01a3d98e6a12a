"""Engine tests import their helpers (fake runner, factories) from `engine_helpers.py` next to this file."""

from __future__ import annotations

import sys
from pathlib import Path

# Only this test folder goes on sys.path (never the repo root: its operator/ folder shadows the stdlib).
_here = str(Path(__file__).parent)
if _here not in sys.path:
    sys.path.insert(0, _here)
