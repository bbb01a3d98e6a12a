"""`overlap model fetch-adapters LIST`: the LoRA adapters a JSON file lists ({name: uri}) fetched into the cache as
a model is (`fetch`: hashes checked, once per version), each behind a link named for its name and uri.

The pod's adapters container runs it with --watch on the file the operator writes into a ConfigMap: when the list
changes (kubelet updates the mounted file), the new adapters are fetched and the links of removed ones go. The
operator then loads each adapter from its link through the sidecar's API; a link's name holds a hash of the uri,
so an adapter whose uri changed is loaded from a new path, never from the old version's folder.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from overlap.engine.delivery.fetch import fetch
from overlap.engine.delivery.sources import FetchError


def link_name(name: str, uri: str) -> str:
    """The link of adapter `name` fetched from `uri`, in the links folder (the operator loads it from there)."""
    return f"{name}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"


def log_prefix(name: str) -> str:
    """How the lines `sync` logs about adapter `name` start."""
    return f"adapter {name}: "


def read_list(path: str | Path) -> dict[str, str]:
    """The {name: uri} file; FetchError when it is not one."""
    try:
        listed = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise FetchError(f"{path}: cannot read the adapter list: {exc}") from exc
    if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
        raise FetchError(f"{path}: the adapter list must be a JSON object of name -> uri")
    return listed


def sync(wanted: Mapping[str, str], cache_dir: str | Path, link_dir: str | Path, *,
         progress: Callable[[str], None] = print) -> dict[str, str]:  # fmt: skip
    """Fetch and link every adapter in `wanted`, remove the links no adapter in it has; {name: why} of those that
    failed (the others are fetched: one bad uri holds up no other adapter)."""
    links = Path(link_dir)
    links.mkdir(parents=True, exist_ok=True)
    failed = {}
    for name, uri in wanted.items():
        # each line names its adapter: the operator puts an adapter's last one into its status (`log_prefix`)
        say = lambda line, name=name: progress(f"{log_prefix(name)}{line}")  # noqa: E731
        try:
            fetch(uri, cache_dir, link=links / link_name(name, uri), progress=say)
        except FetchError as exc:
            failed[name] = str(exc)
            say(f"error: {exc}")
    keep = {link_name(name, uri) for name, uri in wanted.items()}
    for link in links.iterdir():
        if link.is_symlink() and link.name not in keep:
            link.unlink()
            progress(f"adapter link {link.name} removed (no longer listed)")
    return failed


def watch(list_file: str | Path, cache_dir: str | Path, link_dir: str | Path, *, interval_s: float,
          progress: Callable[[str], None] = print, rounds: int | None = None) -> None:  # fmt: skip
    """`sync` whenever the list changes, and again every `interval_s` while an adapter failed (a source that was
    down); `rounds` stops it (tests), None runs until killed."""
    synced, failed, done = None, {}, 0
    while rounds is None or done < rounds:
        try:
            wanted = read_list(list_file)
        except FetchError as exc:  # kubelet swaps the file in one rename; a bad file waits for the next one
            progress(str(exc))
            wanted = synced
        if wanted is not None and (wanted != synced or failed):
            failed = sync(wanted, cache_dir, link_dir, progress=progress)
            synced = wanted
        done += 1
        if rounds is None or done < rounds:
            time.sleep(interval_s)
