"""Trace families for the control benchmark: seeded, disjoint splits, each the shape it says; a CSV in the Azure
trace's schema replays like the shipped one."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from overlap.bench.trace_families import FAMILIES, HOUR_S, azure_mean_rps, resolve, split_seeds
from overlap.bench.trace_generators import shipped_azure
from overlap.bench.traces import TraceError
from overlap.cli import main


def per_minute(trace) -> np.ndarray:
    arrivals = np.array([r.arrival_s for r in trace.requests])
    return np.bincount((arrivals // 60).astype(int), minlength=60)[:60] / 60


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"bursts"}))  # bursts: test_traces
def test_each_family_is_seeded(family):
    one, same, other = (resolve(f"{family}:{seed}") for seed in (1, 1, 2))
    assert one.requests == same.requests and one.requests != other.requests
    assert one.name == f"{family}-seed1" and one.transforms  # the family's note is carried to every figure
    assert all(r.prompt_tokens >= 1 and r.max_tokens >= 1 for r in one.requests[:1000])


def test_splits_draw_disjoint_seeds_and_bad_names_are_refused():
    train, test = split_seeds("train", 40), split_seeds("test", 40)
    assert len(set(train)) == 40 and not set(train) & set(test)
    with pytest.raises(TraceError, match="train or test"):
        split_seeds("validation", 4)
    with pytest.raises(TraceError, match="whole number"):
        resolve("pareto:x")
    with pytest.raises(TraceError, match="neither a file nor a built-in"):
        resolve("nosuch:1")


def test_the_families_have_their_shapes():
    m = azure_mean_rps()
    flash, wave, pareto, selfsim = (resolve(f"{family}:3") for family in ("flash", "wave", "pareto", "selfsim"))
    rates = per_minute(flash)
    assert rates.max() > 4 * np.median(rates)  # a step of 5-20x over the base, decaying back
    rates = per_minute(wave)
    assert rates[25:35].mean() > 2 * max(rates[:5].mean(), rates[-5:].mean())  # the peak at half-time
    rates = per_minute(pareto)
    assert rates.max() > 1.2 * m and np.min(rates) < 0.6 * m
    rates = per_minute(selfsim)
    assert 0.5 * m < rates.mean() < 1.3 * m and rates.std() > 0.1 * rates.mean()
    azure, conv = shipped_azure(), resolve("conv:3")
    assert len(conv.requests) == len(azure.requests)
    assert conv.duration_s != pytest.approx(azure.duration_s, rel=0.05)  # compressed (or stretched)
    for trace in (flash, wave, pareto, selfsim):
        assert trace.duration_s == pytest.approx(HOUR_S, abs=60)


def test_a_csv_in_the_azure_schema_replays_on_the_modelled_fleet(tmp_path):
    rows = [f"2024-05-01 10:00:{s // 10:02d}.{s % 10}000000,{200 + s},{30 + s % 7}" for s in range(300)]
    path = tmp_path / "my-service.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(
            ["bench", "control", "--trace", str(path), "--fleet", "model", "--runs", "statics,overlap",
             "--max-replicas", "3", "--json", "--no-progress", "--out", str(tmp_path / "out")]
        )  # fmt: skip
    assert rc == 0
    report = json.loads(stdout.getvalue())
    assert report["fleet"] == "model" and "my-service" in report["trace"]
    assert "x60" in report["trace"]  # the Azure schema gets the Azure defaults
    runs = {run["label"]: run for run in report["runs"]}
    assert set(runs) == {"static-1", "static-2", "static-3", "overlap"}
    for run in runs.values():
        assert run["requests"] == 300 and run["finished"] + run["unfinished"] == 300
    assert runs["static-3"]["replica_seconds"] > runs["static-1"]["replica_seconds"]
