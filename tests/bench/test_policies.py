"""Batching-policy semantics on a fake clock (overlap.engine.batching.policies), as the scheduler consults them: at
every step, with the waiting requests' arrival times (oldest first) and the number running."""

from __future__ import annotations

import pytest

from overlap.engine.batching.policies import make_batching_policy
from overlap.engine.errors import ConfigError
from overlap.engine.requests.queue import make_request_queue
from overlap.engine.requests.request import Request
from overlap.engine.types import RequestSpec, RequestTimes, SamplingParams


def _request(rid: str, arrived: float, priority: int = 1, deadline: float | None = None) -> Request:
    return Request(
        RequestSpec(rid, [5, 6, 7], SamplingParams(max_tokens=4), priority), RequestTimes(arrived=arrived), deadline
    )


@pytest.mark.parametrize("queue_policy", ["fifo", "priority"])
def test_the_queue_hands_policies_its_arrival_times_sorted(queue_policy):
    queue = make_request_queue(queue_policy, 3, aging_s=100)
    for rid, arrived, priority in [("a", 0.3, 2), ("b", 0.1, 1), ("c", 0.2, 0), ("d", 0.2, 2), ("e", 0.5, 1)]:
        queue.add(_request(rid, arrived, priority, deadline=1.0 if rid == "e" else None), arrived)
    assert list(queue.arrival_times()) == [0.1, 0.2, 0.2, 0.3, 0.5]
    popped = queue.pop()  # the head: FIFO "a" (0.3), priority "c" (0.2)
    assert popped.request_id == ("a" if queue_policy == "fifo" else "c")
    queue.remove("b")
    assert [r.request_id for r in queue.pop_expired(2.0)] == ["e"]
    queue.add_front(popped, 0.6)  # preempted: back in the queue with its own arrival time
    assert list(queue.arrival_times()) == sorted(r.times.arrived for r in queue)
    assert queue.arrival_times()[0] == 0.2


def test_serial_admits_one_when_idle():
    policy = make_batching_policy("serial")
    assert policy.num_to_admit(0.0, [0.0] * 5, 0) == 1
    assert policy.num_to_admit(0.1, [0.0] * 4, 1) == 0
    assert policy.num_to_admit(0.2, [], 0) == 0


def test_continuous_admits_everything_waiting():
    policy = make_batching_policy("continuous")
    assert policy.num_to_admit(0.0, [0.0] * 7, 30) == 7


def test_dynamic_dispatches_when_full_or_when_the_oldest_has_waited():
    policy = make_batching_policy("dynamic", {"max_batch": 4, "max_wait_ms": 100})
    assert policy.num_to_admit(0.00, [0.0, 0.0], 0) == 0  # not full, oldest waited 0 ms
    assert policy.num_to_admit(0.05, [0.0, 0.01, 0.04], 0) == 0
    assert policy.num_to_admit(0.06, [0.0, 0.01, 0.04, 0.05, 0.055, 0.06], 0) == 4  # full: a batch of max_batch
    assert policy.num_to_admit(0.07, [0.055, 0.06], 4) == 0  # static: the batch runs until all members finish
    assert policy.num_to_admit(0.12, [0.055, 0.06], 0) == 0  # free, oldest waited 65 ms
    assert policy.num_to_admit(0.16, [0.055, 0.06], 0) == 2  # waited 105 ms: dispatch what is there


def test_fixed_window_batches_the_arrivals_of_one_window():
    policy = make_batching_policy("fixed_window", {"window_ms": 100})
    # windows from the first arrival (0.02): [0.02, 0.12), [0.12, 0.22), [0.22, 0.32), ...
    assert policy.num_to_admit(0.05, [0.02, 0.04, 0.05], 0) == 0  # window 0 still open
    # window 0 closed, device free: exactly its three requests, not the two that arrived in window 1
    assert policy.num_to_admit(0.13, [0.02, 0.04, 0.05, 0.121, 0.125], 0) == 3
    # window 1 keeps collecting while the batch runs; later arrivals fall in windows 2 and 3
    assert policy.num_to_admit(0.30, [0.121, 0.125, 0.2, 0.25, 0.31], 3) == 0
    # the device frees up at 0.40: window 1's batch (3 requests), not the whole backlog of 5
    assert policy.num_to_admit(0.40, [0.121, 0.125, 0.2, 0.25, 0.31], 0) == 3
    assert policy.num_to_admit(0.41, [0.25, 0.31], 3) == 0
    assert policy.num_to_admit(0.50, [0.25, 0.31], 0) == 2  # window 2 = [0.22, 0.32)


def test_fixed_window_skips_empty_windows_and_waits_for_the_open_one():
    policy = make_batching_policy("fixed_window", {"window_ms": 50})
    assert policy.num_to_admit(0.01, [0.0], 0) == 0
    assert policy.num_to_admit(0.06, [0.0], 0) == 1
    # nothing arrived for a while; the next arrival's window [1.0, 1.05) must close before it goes
    assert policy.num_to_admit(1.02, [1.01, 1.02], 0) == 0
    assert policy.num_to_admit(1.05, [1.01, 1.02, 1.049], 0) == 3


def test_fixed_window_batch_size_follows_the_rate_not_the_backlog():
    policy = make_batching_policy("fixed_window", {"window_ms": 50})
    waiting: list[float] = []
    running, busy_until, batches = 0, 0.0, []
    for step in range(400):  # 10 ms steps; one arrival per step (100 req/s); each batch runs 300 ms
        now = step * 0.01 + 0.008
        waiting.append(step * 0.01 + (0.007 if step else 0.005))  # windows start at 0.005: arrivals off their edges
        if running and now >= busy_until:
            running = 0
        n = policy.num_to_admit(now, waiting, running)
        if n:
            del waiting[:n]
            running, busy_until = n, now + 0.3
            batches.append(n)
    assert len(waiting) > 50  # a backlog builds
    assert set(batches) == {5}  # yet every batch is one window: 100 req/s x 50 ms


def test_fixed_window_forgets_requests_that_left_the_queue():
    policy = make_batching_policy("fixed_window", {"window_ms": 100})
    assert policy.num_to_admit(0.0, [0.0, 0.01, 0.02, 0.03], 0) == 0
    # two of the four timed out before the window closed
    assert policy.num_to_admit(0.12, [0.02, 0.03], 0) == 2


def test_fixed_window_never_stalls_on_a_window_end_rounded_onto_an_arrival():
    policy = make_batching_policy("fixed_window", {"window_ms": 50})
    policy.num_to_admit(0.0, [0.0], 1)  # origin 0
    # 2.15 / 0.05 rounds below 43 in floating point, so the computed window end equals the arrival itself
    assert policy.num_to_admit(2.3, [2.15], 0) == 1


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("fifo", {}, "unknown batching policy"),
        ("dynamic", {"max_batch": 0}, "must be > 0"),
        ("fixed_window", {"max_batch": 4}, "does not take"),
        ("fixed_window", {"_origin": 4}, "does not take"),
    ],
)
def test_bad_policy_arguments_are_refused(name, args, message):
    with pytest.raises(ConfigError, match=message):
        make_batching_policy(name, args)
