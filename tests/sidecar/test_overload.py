"""Overload: a burst of 10x capacity gets fast 429s with Retry-After, every accepted request completes, nothing
refused reaches the engine, and the sidecar's memory stays bounded across bursts."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.sidecar import Stack, metric_value, wait_until

CAPACITY = 16  # --max-inflight and --max-queued-requests
PROMPT = [100, 101, 102, 103]  # token ids: an exact prompt length
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    workdir = Path(tempfile.mkdtemp(prefix="ovl-load-"))
    watermarks = ("--max-inflight", str(CAPACITY), "--max-queued-requests", str(CAPACITY))
    s = Stack(workdir, tiny_model_dir, step_s=0.02, sidecar_args=watermarks).start()
    yield s
    s.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def burst(stack, n: int) -> list[tuple[int, float, dict, str | None]]:
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}

    async def one(session):
        started = time.monotonic()
        async with session.post(f"{stack.base_url}/v1/completions", json=body) as response:
            data = await response.json()
            return response.status, time.monotonic() - started, data, response.headers.get("Retry-After")

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session) for _ in range(n)))


@pytest.mark.reliability
async def test_burst_of_ten_times_capacity(stack, reliability):
    prompt_tokens_before = metric_value(stack.metrics(), "overlap_engine_prompt_tokens_total") or 0
    results = await burst(stack, 10 * CAPACITY)
    accepted = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert len(accepted) + len(rejected) == len(results), {r[0] for r in results}
    assert CAPACITY <= len(accepted) < len(results) / 2
    for _, _, data, retry_after in rejected:
        assert data["error"]["type"] == "rate_limit_error"
        assert retry_after is not None and 1 <= int(retry_after) <= 60
    rejected_times = sorted(r[1] for r in rejected)
    accepted_times = sorted(r[1] for r in accepted)
    # Refusals are answered before any engine work: far faster than a served request (30 steps of 20 ms).
    assert rejected_times[len(rejected_times) // 2] < accepted_times[0]
    for _, _, data, _ in accepted:
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["completion_tokens"] == MAX_TOKENS
    metrics = stack.metrics()
    refused = sum(metric_value(metrics, "overlap_requests_rejected_total", f'reason="{r}"') or 0
                  for r in ("inflight", "queued_requests", "queued_tokens"))  # fmt: skip
    assert refused == len(rejected)

    # Only accepted requests reached the engine.
    expected = prompt_tokens_before + len(accepted) * len(PROMPT)
    wait_until(lambda: metric_value(stack.metrics(), "overlap_engine_prompt_tokens_total") == expected, 5,
               "engine prompt-token count")  # fmt: skip
    served = [r for r in accepted if r[2]["usage"]["completion_tokens"] == MAX_TOKENS]
    median_refusal_s = rejected_times[len(rejected_times) // 2]
    reliability.row(
        "Sidecar", f"a burst of 10x capacity ({10 * CAPACITY} requests at once, capacity {CAPACITY})",
        load=f"{10 * CAPACITY} completions of {MAX_TOKENS} tokens",
        outcome=f"{len(rejected)} refused with 429 and Retry-After (median answer {median_refusal_s:.3f} s, before "
        f"any engine work); the {len(accepted)} accepted all served in full",
        accepted=len(accepted), answered=len(served),
    )  # fmt: skip


async def test_memory_stays_bounded_across_bursts(stack):
    await burst(stack, 10 * CAPACITY)
    after_first = rss_kib(stack.sidecar.pid)
    for _ in range(3):
        results = await burst(stack, 10 * CAPACITY)
        assert all(r[0] in (200, 429) for r in results)
    growth_mib = (rss_kib(stack.sidecar.pid) - after_first) / 1024
    assert growth_mib < 20, f"sidecar RSS grew by {growth_mib:.1f} MiB over three more bursts"
    assert metric_value(stack.metrics(), "overlap_sidecar_inflight_requests") == 0
    assert metric_value(stack.metrics(), "overlap_sidecar_queued_requests") == 0
