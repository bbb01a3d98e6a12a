"""`overlap model fetch` from a loopback hub against the loopback link itself, for synthetic models of N GB (2 GiB
safetensors shards): the link's rate (the same files over plain parallel GETs, bytes discarded), the cold fetch's
rate (download, hash check, move into place) and the warm fetch's time (found in the cache), in process and as the
`overlap model fetch` command an init container runs. The hub runs in its own process (tests/support/model_sources.py),
so it does not share the fetch's interpreter.

    .venv/bin/python -m bench.fetch_rate 1 5      # from the repository root; needs N GB of memory and 2N of disk
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _serve(gb: float, ready: multiprocessing.Queue, stop) -> None:
    from tests.support.model_sources import HubServer

    files = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}"}
    block, left, index = os.urandom(64 << 20), int(gb * 1e9), 0
    while left > 0:
        size = min(2 << 30, left)
        files[f"model-{index:05d}-of-N.safetensors"] = (block * (size // len(block) + 1))[:size]
        left, index = left - size, index + 1
    hub = HubServer({"acme/synthetic": files}).start()
    ready.put((hub.url, list(files)))
    stop.wait()
    hub.stop()


def main(sizes: list[float]) -> None:
    import httpx2

    from overlap.engine.delivery.fetch import fetch

    print("| model | loopback link | cold fetch | share of the link | warm fetch | warm, as a command |")
    print("|---|---|---|---|---|---|")
    for gb in sizes:
        ready, stop = multiprocessing.Queue(), multiprocessing.Event()
        server = multiprocessing.Process(target=_serve, args=(gb, ready, stop))
        server.start()
        url, names = ready.get(timeout=600)
        os.environ["HF_ENDPOINT"] = url

        def get(name: str, url: str = url) -> int:
            with (
                httpx2.Client(timeout=60) as client,
                client.stream("GET", f"{url}/acme/synthetic/resolve/main/{name}") as r,
            ):
                return sum(len(chunk) for chunk in r.iter_bytes(1 << 20))

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            sent = sum(pool.map(get, names))
        link = sent / (time.monotonic() - started)
        cache = tempfile.mkdtemp(dir=REPO / ".cache")
        try:
            started = time.monotonic()
            _, fetched = fetch("hf://acme/synthetic", cache, progress=lambda _: None)
            cold_s = time.monotonic() - started
            started = time.monotonic()
            _, again = fetch("hf://acme/synthetic", cache, progress=lambda _: None)
            warm_s = time.monotonic() - started
            command = [
                sys.executable,
                "-m",
                "overlap.cli",
                "model",
                "fetch",
                "hf://acme/synthetic",
                "--cache-dir",
                cache,
            ]
            started = time.monotonic()
            subprocess.run(command, check=True, capture_output=True)
            command_s = time.monotonic() - started
        finally:
            shutil.rmtree(cache)
            stop.set()
            server.join()
        cold = fetched / cold_s
        print(
            f"| {gb:g} GB, {len(names) - 2} shards | {link / 1e6:.0f} MB/s | {cold / 1e6:.0f} MB/s ({cold_s:.1f} s) "
            f"| {cold / link:.0%} | {warm_s:.2f} s, {again} bytes | {command_s:.2f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main([float(arg) for arg in sys.argv[1:]] or [1.0])
