"""Batching-policy semantics on a fake clock (engine/batching.py), as the scheduler consults them: at every step,
with the number of waiting requests, the oldest arrival and the number running."""

from __future__ import annotations

import pytest

from overlap.engine.batching import make_batching_policy
from overlap.engine.errors import ConfigError


def test_serial_admits_one_when_idle():
    policy = make_batching_policy("serial")
    assert policy.num_to_admit(0.0, 5, 0.0, 0) == 1
    assert policy.num_to_admit(0.1, 4, 0.0, 1) == 0
    assert policy.num_to_admit(0.2, 0, None, 0) == 0


def test_continuous_admits_everything_waiting():
    policy = make_batching_policy("continuous")
    assert policy.num_to_admit(0.0, 7, 0.0, 30) == 7


def test_dynamic_dispatches_when_full_or_when_the_oldest_has_waited():
    policy = make_batching_policy("dynamic", {"max_batch": 4, "max_wait_ms": 100})
    assert policy.num_to_admit(0.00, 2, 0.0, 0) == 0  # not full, oldest waited 0 ms
    assert policy.num_to_admit(0.05, 3, 0.0, 0) == 0
    assert policy.num_to_admit(0.06, 6, 0.0, 0) == 4  # full: a batch of max_batch
    assert policy.num_to_admit(0.07, 2, 0.06, 4) == 0  # static: the batch runs until all members finish
    assert policy.num_to_admit(0.12, 2, 0.06, 0) == 0  # free, oldest waited 60 ms
    assert policy.num_to_admit(0.16, 2, 0.06, 0) == 2  # waited 100 ms: dispatch what is there


def test_fixed_window_batches_the_arrivals_of_one_window():
    policy = make_batching_policy("fixed_window", {"window_ms": 100})
    # window 0 = [0, 0.1): three arrivals seen at steps inside it
    assert policy.num_to_admit(0.00, 1, 0.0, 0) == 0
    assert policy.num_to_admit(0.05, 3, 0.0, 0) == 0
    # window 0 closed, device free: exactly its three requests, though two more arrived since (window 1)
    assert policy.num_to_admit(0.11, 5, 0.0, 0) == 3
    # window 1 = [0.1, 0.2) keeps collecting while the batch runs; window 2 starts at 0.2
    assert policy.num_to_admit(0.15, 3, 0.1, 3) == 0
    assert policy.num_to_admit(0.25, 6, 0.1, 3) == 0
    # the device frees up at 0.4: window 1's batch (3 requests), not the whole backlog of 6
    assert policy.num_to_admit(0.40, 6, 0.1, 0) == 3
    assert policy.num_to_admit(0.41, 3, 0.2, 3) == 0
    assert policy.num_to_admit(0.60, 3, 0.2, 0) == 3  # window 2


def test_fixed_window_batch_size_follows_the_rate_not_the_backlog():
    policy = make_batching_policy("fixed_window", {"window_ms": 50})
    waiting, running, busy_until, batches = 0, 0, 0.0, []
    for step in range(400):  # 10 ms steps; one arrival per step (100 req/s); each batch runs 300 ms
        now = step * 0.01 + 0.005  # off the window boundaries
        waiting += 1
        if running and now >= busy_until:
            running = 0
        n = policy.num_to_admit(now, waiting, 0.0, running)
        if n:
            waiting -= n
            running, busy_until = n, now + 0.3
            batches.append(n)
    assert waiting > 50  # a backlog builds
    assert set(batches[1:]) == {5}  # yet every batch is one window: 100 req/s x 50 ms


def test_fixed_window_forgets_requests_that_left_the_queue():
    policy = make_batching_policy("fixed_window", {"window_ms": 100})
    policy.num_to_admit(0.0, 4, 0.0, 0)
    # two of the four timed out before the window closed
    assert policy.num_to_admit(0.12, 2, 0.0, 0) == 2


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("fifo", {}, "unknown batching policy"),
        ("dynamic", {"max_batch": 0}, "must be > 0"),
        ("fixed_window", {"max_batch": 4}, "does not take"),
    ],
)
def test_bad_policy_arguments_are_refused(name, args, message):
    with pytest.raises(ConfigError, match=message):
        make_batching_policy(name, args)
