"""What a long benchmark shows while it runs: progress lines and bars, the machine's load average, and how often a
replay samples."""

from __future__ import annotations

import os
import sys
import time

SAMPLE_EVERY_S = 0.1


def load_average() -> float | None:
    """The machine's 1-minute load average (other processes compete for the cores; printed with each run)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def progress_bar(total: int, label: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=label[:32],
        unit="req",
        file=sys.stderr,
        disable=not enabled,
        mininterval=0.5,
        leave=False,
        dynamic_ncols=True,
    )


def log_progress(message: str) -> None:
    """One progress line on stderr, with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
