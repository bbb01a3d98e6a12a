"""Device-busy accounting from recorded intervals: ratio over a window, idle gaps, host phases."""

from __future__ import annotations

import threading

import pytest

from overlap.engine.execution.busy import BusyTracker


def test_ratio_and_gaps_from_intervals():
    busy = BusyTracker(window_s=100)
    # 4 ms busy, 1 ms idle, repeated: 80% busy
    for i in range(10):
        busy.record_interval(i * 0.005, i * 0.005 + 0.004)
    snap = busy.snapshot()
    assert snap.busy_ratio == pytest.approx(0.04 / 0.049)
    assert snap.num_steps == 10 and snap.busy_s == pytest.approx(0.04)
    assert snap.idle_gap_ms["count"] == 9
    assert snap.idle_gap_ms["p50"] == pytest.approx(1.0) and snap.idle_gap_ms["max"] == pytest.approx(1.0)


def test_window_slides_and_clips_intervals():
    busy = BusyTracker(window_s=1.0)
    busy.record_interval(0.0, 1.0)  # fully busy second, then a mostly idle one
    busy.record_interval(1.5, 2.0)
    snap = busy.snapshot()  # window [1.0, 2.0]
    assert snap.window_s == pytest.approx(1.0) and snap.busy_ratio == pytest.approx(0.5)
    later = busy.snapshot(now=3.0)  # nothing ran in [2, 3]
    assert later.busy_ratio == 0.0 and later.num_steps == 0
    partial = busy.snapshot(now=2.25)  # window [1.25, 2.25] sees 0.5 s of busy time
    assert partial.busy_ratio == pytest.approx(0.5)


def test_pause_excludes_the_gap_after_running_out_of_work():
    busy = BusyTracker(window_s=100)
    busy.record_interval(0.0, 0.004)
    busy.record_interval(0.005, 0.009)
    busy.pause()
    busy.record_interval(5.0, 5.004)  # the engine had nothing to do for 5 s: not an overhead gap
    snap = busy.snapshot()
    assert snap.idle_gap_ms["count"] == 1 and snap.idle_gap_ms["max"] == pytest.approx(1.0)
    assert snap.busy_ratio < 0.01  # but the device was idle, and the ratio says so


def test_host_phases_and_empty_stats():
    busy = BusyTracker()
    empty = busy.snapshot()
    assert empty.busy_ratio == 0.0 and empty.num_steps == 0 and empty.idle_gap_ms["count"] == 0
    for seconds in (0.001, 0.003):
        busy.record_host("schedule", seconds)
    busy.record_host("readback", 0.0005)
    snap = busy.snapshot()
    assert snap.host_ms_per_step == pytest.approx({"schedule": 2.0, "readback": 0.5})
    assert set(snap.to_dict()) >= {"busy_ratio", "idle_gap_ms", "host_ms_per_step"}


def test_concurrent_recording_loses_nothing():
    busy = BusyTracker(window_s=1e9, max_steps=100_000)

    def record(offset):
        for i in range(2000):
            busy.record_interval(offset + i, offset + i + 0.5)

    threads = [threading.Thread(target=record, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(200):
        busy.snapshot()
    for t in threads:
        t.join()
    assert busy.num_steps_total == 8000 and busy.busy_s_total == pytest.approx(4000)


def test_kernel_union_counts_overlapping_kernels_once():
    from overlap.engine.execution.busy import kernel_union_s

    assert kernel_union_s([]) == 0
    assert kernel_union_s([(0, 2), (1, 3), (5, 6), (5.5, 5.7), (10, 10)]) == 4


def test_kernel_share_scales_the_busy_figures():
    tracker = BusyTracker(window_s=100)
    for i in range(10):
        tracker.record_interval(i, i + 1)  # event-bracketed: busy the whole time
    assert tracker.snapshot().kernel_share is None and tracker.snapshot().kernel_busy_ratio is None
    for share in (0.4, 0.5, 1.7):  # a launch-bound step: kernels ran under half of its event time
        tracker.record_kernel_share(share)
    snap = tracker.snapshot()
    assert snap.busy_ratio == 1.0 and snap.kernel_share == 0.5 and snap.kernel_busy_ratio == 0.5
    assert snap.to_dict()["kernel_busy_ratio"] == 0.5
