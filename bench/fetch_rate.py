"""`overlap model fetch` from loopback sources against the loopback link itself, for synthetic models of N GB (2 GiB
safetensors shards): the link's rate (the same files over plain parallel GETs, bytes discarded), the cold fetch's
rate (download, hash check, move into place) and the warm fetch's time (found in the cache), in process and as the
`overlap model fetch` command an init container runs. Two sources: the loopback hub (Python, in its own process:
tests/support/model_sources.py) and Debian's docker-registry (Go) holding the same files as an ORAS artifact.

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


def _synthetic(gb: float) -> dict[str, bytes]:
    files = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}"}
    block, left, index = os.urandom(64 << 20), int(gb * 1e9), 0
    while left > 0:
        size = min(2 << 30, left)
        files[f"model-{index:05d}-of-N.safetensors"] = (block * (size // len(block) + 1))[:size]
        left, index = left - size, index + 1
    return files


def _serve(gb: float, ready: multiprocessing.Queue, stop) -> None:
    from tests.support.model_sources import HubServer

    files = _synthetic(gb)
    hub = HubServer({"acme/synthetic": files}).start()
    ready.put((hub.url, list(files)))
    stop.wait()
    hub.stop()


def _link_rate(urls: list[str]) -> float:
    """Bytes per second of plain parallel GETs of `urls`, the bytes discarded."""
    import httpx2

    def get(url: str) -> int:
        with httpx2.Client(timeout=60) as client, client.stream("GET", url) as response:
            return sum(len(chunk) for chunk in response.iter_bytes(1 << 20))

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        sent = sum(pool.map(get, urls))
    return sent / (time.monotonic() - started)


def _measure(uri: str, link: float, label: str) -> None:
    from overlap.engine.delivery.fetch import fetch

    cache = tempfile.mkdtemp(dir=REPO / ".cache")
    try:
        started = time.monotonic()
        _, fetched = fetch(uri, cache, progress=lambda _: None)
        cold_s = time.monotonic() - started
        started = time.monotonic()
        _, again = fetch(uri, cache, progress=lambda _: None)
        warm_s = time.monotonic() - started
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "overlap.cli", "model", "fetch", uri, "--cache-dir", cache],
                       check=True, capture_output=True)  # fmt: skip
        command_s = time.monotonic() - started
    finally:
        shutil.rmtree(cache)
    cold = fetched / cold_s
    print(f"| {label} | {link / 1e6:.0f} MB/s | {cold / 1e6:.0f} MB/s ({cold_s:.1f} s) | {cold / link:.0%} "
          f"| {warm_s:.2f} s, {again} bytes | {command_s:.2f} s |", flush=True)  # fmt: skip


def _registry_rows(gb: float, files: dict[str, bytes]) -> None:
    from oras.provider import Registry

    from tests.support.model_sources import RegistryServer

    workdir = Path(tempfile.mkdtemp(dir=REPO / ".cache"))
    registry = RegistryServer(workdir)
    try:
        for name, data in files.items():
            (workdir / name).write_bytes(data)
        client = Registry(hostname=registry.host, insecure=True)
        client.push(target=f"{registry.host}/acme/synthetic:v1", files=[str(workdir / name) for name in files],
                    disable_path_validation=True, do_chunked=True, chunk_size=64 << 20, quiet=True)  # fmt: skip
        for name in files:
            (workdir / name).unlink()
        manifest = client.get_manifest(f"{registry.host}/acme/synthetic:v1")
        blobs = [f"http://{registry.host}/v2/acme/synthetic/blobs/{layer['digest']}" for layer in manifest["layers"]]
        os.environ["OVERLAP_OCI_PLAIN_HTTP"] = registry.host
        _measure(f"oci://{registry.host}/acme/synthetic:v1", _link_rate(blobs),
                 f"{gb:g} GB, {len(files) - 2} shards, registry")  # fmt: skip
    finally:
        registry.stop()
        shutil.rmtree(workdir)


def main(sizes: list[float]) -> None:
    print("| model, source | loopback link | cold fetch | share of the link | warm fetch | warm, as a command |")
    print("|---|---|---|---|---|---|")
    for gb in sizes:
        ready, stop = multiprocessing.Queue(), multiprocessing.Event()
        server = multiprocessing.Process(target=_serve, args=(gb, ready, stop))
        server.start()
        url, names = ready.get(timeout=600)
        os.environ["HF_ENDPOINT"] = url
        try:
            link = _link_rate([f"{url}/acme/synthetic/resolve/main/{name}" for name in names])
            _measure("hf://acme/synthetic", link, f"{gb:g} GB, {len(names) - 2} shards, hub")
        finally:
            stop.set()
            server.join()
        _registry_rows(gb, _synthetic(gb))


if __name__ == "__main__":
    main([float(arg) for arg in sys.argv[1:]] or [1.0])
