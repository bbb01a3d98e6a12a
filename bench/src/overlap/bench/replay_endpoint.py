"""`overlap bench replay --target URL`: replay a trace against an OpenAI-compatible endpoint, every request a
streaming `/v1/completions` call sent at its arrival offset, timestamps taken on the client."""

from __future__ import annotations

import asyncio
import json
import time

from overlap.bench.meter import SAMPLE_EVERY_S, load_average, progress_bar
from overlap.bench.report import RequestRecord, RunResult
from overlap.bench.traces import DEFAULT_PRIORITY, Trace, TraceRequest
from overlap.bench.workload import prompt_token_ids


async def replay_target(
    trace: Trace,
    url: str,
    drain_s: float,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
    label: str | None = None,
) -> RunResult:
    """Replay `trace` against an OpenAI-compatible endpoint with streaming; timestamps taken on the client."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        if model is None:
            from overlap.bench.served import served_model

            model = await served_model(session, url, "--target", "--model")
        records = [RequestRecord(f"r{i}", r.arrival_s) for i, r in enumerate(trace.requests)]
        bar = progress_bar(len(records), url, progress)
        in_flight = 0
        samples: list[tuple[float, int, int, float | None]] = []
        start = time.monotonic()

        async def one(i: int, request: TraceRequest) -> None:
            nonlocal in_flight
            record = records[i]
            if request.prompt is not None:
                prompt: str | list[int] = request.prompt
            else:
                prompt = prompt_token_ids(request, i, seed)
                record.num_prompt_tokens = len(prompt)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": request.max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            if request.priority != DEFAULT_PRIORITY:  # only when the trace asks: servers differ in what they accept
                body["priority"] = request.priority
            record.arrived = time.monotonic() - start
            in_flight += 1
            try:
                await _stream_completion(session, url, body, record, start)
            except asyncio.CancelledError:
                record.status = "unfinished"
                raise
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                record.status, record.detail = "failed", f"{type(exc).__name__}: {exc}"
            finally:
                in_flight -= 1
                if record.status != "unfinished":
                    bar.update(1)

        async def sampler() -> None:
            while True:
                samples.append((time.monotonic() - start, in_flight, in_flight, None))
                await asyncio.sleep(SAMPLE_EVERY_S)

        load_before = load_average()
        sampling_task = asyncio.create_task(sampler())
        tasks = []
        for i, request in enumerate(trace.requests):
            delay = start + request.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, request)))
        submit_end = time.monotonic() - start
        _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - start
        sampling_task.cancel()
        bar.close()
    return RunResult(
        label=label or url,
        mode="target",
        config={"target": url, "model": model, "load_average": [load_before, load_average()]},
        records=records,
        wall_s=wall,
        submit_end_s=submit_end,
        samples=samples,
    )


async def _stream_completion(session, url: str, body: dict, record: RequestRecord, start: float) -> None:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status in (429, 503):
            record.status, record.detail = "rejected", f"HTTP {response.status}"
            return
        if response.status != 200:
            text = (await response.text())[:200]
            record.status, record.detail = "failed", f"HTTP {response.status}: {text}"
            return
        usage_tokens = None
        async for raw in response.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                record.status, record.detail = "failed", str(chunk["error"])[:200]
                return
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                t = time.monotonic() - start
                if record.first_token is None:
                    record.first_token = t
                record.token_times.append(t)
        record.finished = time.monotonic() - start
        record.num_output_tokens = usage_tokens if usage_tokens is not None else len(record.token_times)
        record.status = "finished"
        if record.first_token is None:
            record.first_token = record.finished
