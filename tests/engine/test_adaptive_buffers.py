"""Adaptive buffers: the rule and its hysteresis, on hand-made measurements."""

from __future__ import annotations

from overlap.engine.execution.adaptive_buffers import BufferAdvisor, decide


def test_decide_follows_the_pipeline_arithmetic():
    device = [0.004] * 100
    assert decide([0.00002] * 100, device)[0] == 1  # 0.5% of the step: nothing to overlap
    assert decide([0.0015] * 100, device)[0] == 2  # hidden by double buffering
    spiky = [0.0015, 0.0015, 0.0015, 0.0015, 0.0015, 0.0015, 0.0015, 0.0015, 0.007, 0.007] * 10
    number, reason = decide(spiky, device)
    assert number == 3 and "third buffer" in reason
    number, reason = decide([0.006] * 100, device)
    assert number == 2 and "host sets the pace" in reason
    assert decide([], [])[0] == 2


def test_advisor_changes_only_when_confirmed_and_records_why():
    advisor = BufferAdvisor(every_steps=10)
    for _ in range(10):
        advisor.record(0.00001, 0.004)
    assert advisor.advise(2) is None  # first proposal of 1: not yet
    for _ in range(10):
        advisor.record(0.00001, 0.004)
    assert advisor.advise(2) == 1  # confirmed
    decision = advisor.decisions[-1]
    assert (decision.old, decision.new) == (2, 1) and "nothing to overlap" in decision.reason
    assert set(decision.to_dict()) == {"at", "from", "to", "reason"}
    for _ in range(9):
        advisor.record(0.00001, 0.004)
    assert advisor.advise(1) is None  # not due yet, and no change wanted anyway
