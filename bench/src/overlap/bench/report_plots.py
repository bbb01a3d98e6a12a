"""The PNG plots of a replay report: latency distributions, queue depth and device busy over time, and each
request's stages (queued, first token, decode) on one time axis. The runs are `report.RunResult`s; report imports
this module, so it does not import report."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-").lower()[:40] or "run"


def plot_all(runs: list, out_dir: Path, trace_description: str = "") -> dict[str, str]:
    """Write the PNGs; return {title: file name}. Each carries the trace description (and its scaling) as a
    footnote."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    footnote = textwrap.fill(trace_description, 140)

    def save(fig, path: Path) -> None:
        if footnote:
            fig.text(0.01, 0.005, footnote, fontsize=5, color="#555555", va="bottom")
            fig.tight_layout(rect=(0, 0.02 + 0.012 * footnote.count("\n"), 1, 1))
        else:
            fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    plots = {}
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=90)
    for run in runs:
        lat = sorted(
            [r.e2e * 1000 for r in run.records if r.status == "finished" and r.finished is not None]
            + [max(0.0, run.wall_s - r.arrived) * 1000 for r in run.records if r.status == "unfinished"]
        )
        if lat:
            ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=run.label)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out_dir / "latency_cdf.png")
    plots["Latency CDF per run"] = "latency_cdf.png"

    has_busy = any(s[3] is not None for run in runs for s in run.samples)
    fig, axes = plt.subplots(
        2 if has_busy else 1, 1, figsize=(6.4, 4.8 if has_busy else 2.8), dpi=90, sharex=True, squeeze=False
    )
    for run in runs:
        if not run.samples:
            continue
        t = [s[0] for s in run.samples]
        axes[0][0].plot(t, [s[1] for s in run.samples], label=run.label, lw=1)
        if has_busy:
            axes[1][0].plot(t, [np.nan if s[3] is None else s[3] * 100 for s in run.samples], label=run.label, lw=1)
    axes[0][0].set_ylabel("waiting requests" if has_busy else "in-flight requests")
    axes[0][0].set_title("Queue depth" + (" and device busy" if has_busy else "") + " over time")
    axes[0][0].legend(fontsize=7)
    axes[0][0].grid(alpha=0.3)
    if has_busy:
        axes[1][0].set_ylabel("device busy (%)")
        axes[1][0].set_ylim(0, 105)
        axes[1][0].grid(alpha=0.3)
    axes[-1][0].set_xlabel("time since start (s)")
    save(fig, out_dir / "timeline.png")
    plots["Queue depth and device busy over time"] = "timeline.png"

    for run in runs:
        name = f"stages_{_slug(run.label)}.png"
        if _plot_stages(plt, run, out_dir / name, save):
            plots[f"Per-request stages: {run.label}"] = name
    return plots


def _plot_stages(plt, run, path: Path, save, max_requests: int = 80) -> bool:
    """Stacked horizontal bars per request (a sample evenly spread over the run, by arrival): queue, prefill (until
    the first token), decode; requests left unfinished at the drain deadline in grey. For targets the first stage is
    "waiting for the first token"."""
    shown = [
        r
        for r in run.records
        if (r.status == "finished" and r.finished is not None and r.first_token is not None) or r.status == "unfinished"
    ]
    if not any(r.status == "finished" for r in shown):
        return False
    shown.sort(key=lambda r: r.arrived)
    step = max(1, math.ceil(len(shown) / max_requests))
    every = shown[::step]
    left = [(i, r) for i, r in enumerate(every) if r.status == "unfinished"]
    sample = [r for r in every if r.status == "finished"]
    y = np.array([i for i, r in enumerate(every) if r.status == "finished"])
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=90)
    if left:
        ax.barh(
            [i for i, _ in left],
            [run.wall_s - r.arrived for _, r in left],
            left=[r.arrived for _, r in left],
            color="#bbbbbb",
            label="unfinished",
            height=1.0,
        )
    if all(r.first_scheduled is not None for r in sample):
        queue = [r.first_scheduled - r.arrived for r in sample]
        prefill = [r.first_token - r.first_scheduled for r in sample]
        ax.barh(y, queue, left=[r.arrived for r in sample], color="#d62728", label="queued", height=1.0)
        ax.barh(y, prefill, left=[r.first_scheduled for r in sample], color="#ff7f0e", label="prefill", height=1.0)
    else:
        ax.barh(
            y,
            [r.first_token - r.arrived for r in sample],
            left=[r.arrived for r in sample],
            color="#ff7f0e",
            label="until first token",
            height=1.0,
        )
    ax.barh(
        y,
        [r.finished - r.first_token for r in sample],
        left=[r.first_token for r in sample],
        color="#1f77b4",
        label="decode",
        height=1.0,
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"request (1 in {step}, by arrival)" if step > 1 else "request (by arrival)")
    ax.set_title(f"Per-request stages: {run.label}")
    ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    save(fig, path)
    return True
