"""Tensor-parallel ranks seen from outside: their processes, and a streaming load that says how each request ended
(for the tests that kill a rank mid-generation)."""

from __future__ import annotations

import asyncio
from pathlib import Path


def rank_pids(ancestor: int) -> list[int]:
    """The processes of tensor-parallel ranks other than 0 (multiprocessing's spawned children) under `ancestor`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                chain = ancestors(int(entry.name))
            except OSError:
                continue
            if b"multiprocessing.spawn" in cmdline and ancestor in chain:
                found.append(int(entry.name))
    return found


def ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        chain.append(pid)
    return chain


async def stream_completions(url: str, model: str, n: int) -> list[str]:
    """n streaming completions at once; each ends as `finished`, or with the error the server sent."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int) -> str:
        body = {"model": model, "prompt": f"story {i}:", "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        try:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    return f"error {response.status}"
                text = (await response.read()).decode()
                if '"error"' in text:
                    return "error in stream"
                return "finished" if "[DONE]" in text else "cut"
        except aiohttp.ClientError as exc:
            return f"error {type(exc).__name__}"

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))
