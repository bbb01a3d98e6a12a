"""RequestQueue: FIFO and priority-with-aging ordering, front insertion, removal, deadlines."""

from __future__ import annotations

import pytest

from overlap.engine.errors import ConfigError
from overlap.engine.requests.queue import FifoRequestQueue, PriorityRequestQueue, make_request_queue
from tests.support.engine import create_requests


def _drain(queue) -> list[str]:
    return [queue.pop().request_id for _ in range(len(queue))]


def test_fifo_ignores_priority() -> None:
    queue = make_request_queue("fifo", 3, aging_s=5)
    assert isinstance(queue, FifoRequestQueue)
    reqs = [create_requests(1, priority=p)[0] for p in (2, 0, 1)]
    for r in reqs:
        queue.add(r, now=0.0)
    assert _drain(queue) == [r.request_id for r in reqs]


def test_priority_levels_then_fifo_within_a_level() -> None:
    queue = make_request_queue("priority", 3, aging_s=100)
    assert isinstance(queue, PriorityRequestQueue)
    low = create_requests(2, priority=2)
    mid = create_requests(2, priority=1)
    high = create_requests(2, priority=0)
    for r in [low[0], mid[0], high[0], low[1], mid[1], high[1]]:
        queue.add(r, now=0.0)
    assert queue.num_by_priority() == [2, 2, 2]
    assert queue.peek() is high[0]
    assert _drain(queue) == [r.request_id for r in high + mid + low]
    assert queue.num_by_priority() == [0, 0, 0]


def test_add_front_puts_a_preempted_request_back_first_in_its_level() -> None:
    queue = make_request_queue("priority", 3, aging_s=100)
    a, b, c = create_requests(3, priority=1)
    queue.add(a, 0.0)
    queue.add(b, 0.0)
    first = queue.pop()
    assert first is a
    queue.add(c, 1.0)
    queue.add_front(first, 2.0)
    assert _drain(queue) == [a.request_id, b.request_id, c.request_id]


def test_remove_by_id() -> None:
    queue = make_request_queue("priority", 3, aging_s=100)
    reqs = create_requests(3)
    for r in reqs:
        queue.add(r, 0.0)
    assert queue.remove(reqs[1].request_id) is reqs[1]
    assert queue.remove(reqs[1].request_id) is None
    assert reqs[1].request_id not in queue
    assert _drain(queue) == [reqs[0].request_id, reqs[2].request_id]


def test_aging_moves_a_request_up_one_level_per_aging_period() -> None:
    queue = make_request_queue("priority", 3, aging_s=10)
    (low,) = create_requests(1, priority=2)
    queue.add(low, now=0.0)
    queue.update(9.9)
    assert low.queue_level == 2
    queue.update(10.0)
    assert low.queue_level == 1
    queue.update(20.0)
    assert low.queue_level == 0
    # A high-priority request that arrives after the promotion queues behind it (FIFO within level 0).
    (high,) = create_requests(1, priority=0)
    queue.add(high, now=20.5)
    assert _drain(queue) == [low.request_id, high.request_id]


def test_aging_catches_up_several_levels_in_one_scan() -> None:
    queue = make_request_queue("priority", 4, aging_s=1)
    (low,) = create_requests(1, priority=3)
    queue.add(low, now=0.0)
    assert queue.update(3.5) == 1
    assert low.queue_level == 0
    assert queue.num_by_level() == [1, 0, 0, 0]
    assert queue.num_by_priority() == [0, 0, 0, 1]  # stats count by the request's own priority


def test_deadlines_expire_queued_requests_only_before_they_are_scheduled() -> None:
    queue = make_request_queue("priority", 3, aging_s=100)
    soon = create_requests(1, deadline=5.0)[0]
    later = create_requests(1, deadline=50.0)[0]
    none = create_requests(1)[0]
    preempted = create_requests(1, deadline=5.0)[0]
    for r in (soon, later, none, preempted):
        queue.add(r, 0.0)
    preempted.times.first_scheduled = 1.0  # it was served once, then preempted: keeps its place
    assert queue.pop_expired(4.9) == []
    assert queue.pop_expired(5.0) == [soon]
    assert len(queue) == 3 and preempted.request_id in queue
    assert queue.pop_expired(60.0) == [later]
    assert len(queue) == 2


def test_oldest_arrival_leads_the_arrival_times() -> None:
    queue = make_request_queue("priority", 3, aging_s=100)
    assert list(queue.arrival_times()) == []
    queue.add(create_requests(1, priority=2, arrived=1.0)[0], 1.0)
    queue.add(create_requests(1, priority=0, arrived=3.0)[0], 3.0)
    assert queue.arrival_times()[0] == 1.0


def test_unknown_policy() -> None:
    with pytest.raises(ConfigError, match="queue policy"):
        make_request_queue("lifo", 3, 1.0)
