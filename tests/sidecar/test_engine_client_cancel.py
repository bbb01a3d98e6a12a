"""The engine client under cancellation: a cancel must never be lost, or the sidecar's shutdown waits forever.

On Python 3.11, `asyncio.wait_for` returns the inner future's result instead of raising when the task is cancelled
in the same loop iteration as that future completes (CPython gh-86296). The stats poller would then keep polling
after its cancel, and SIGTERM would hang the sidecar (seen in CI: "ignored SIGTERM for 30 s").
"""

from __future__ import annotations

import asyncio

import pytest

from overlap.engine.serving import protocol as p
from overlap.engine.serving.client import EngineClient, EngineUnavailable


class _Writer:
    def write(self, data: bytes) -> None:
        pass


def _connected_client() -> EngineClient:
    client = EngineClient("/nonexistent.sock")
    client._writer = _Writer()  # what a connection sets: enough for _send
    client.hello = p.Hello(
        protocol_version=p.PROTOCOL_VERSION, model_name="m", model_dir="/m", max_model_len=64, vocab_size=8,
        eos_token_id=None, num_priority_levels=1, config={}, engine_pid=1,
    )  # fmt: skip
    return client


async def test_a_cancel_that_lands_with_the_reply_is_not_lost():
    client = _connected_client()
    task = asyncio.create_task(client.stats())
    await asyncio.sleep(0)  # the task now waits for the reply
    (seq,) = client._replies
    client._dispatch(p.StatsReply(seq=seq, stats={"num_waiting": 0}))  # the reply arrives...
    task.cancel()  # ...and the cancel, in the same loop iteration
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_reply_that_never_comes_times_out_with_a_clear_error():
    client = _connected_client()
    with pytest.raises(EngineUnavailable, match=r"did not answer within 0\.05 s"):
        await client.stats(timeout=0.05)
