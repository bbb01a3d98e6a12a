"""Loopback model sources with faults, for `overlap model fetch`: a hub speaking the endpoints huggingface_hub uses
(HF_ENDPOINT), a plain HTTP server for archives, moto's S3 server (its own venv: moto pins a python-dateutil
the kubernetes client refuses), and Debian's docker-registry (the CNCF distribution registry) behind a proxy that
adds the faults.

Faults are queued per file and each served once: "stall" (half the body, then silence), "5xx" (a 503),
"drop" (half the body, then the connection closed), "truncate" (all but the last bytes, then closed), "corrupt"
(the body with a flipped byte, every time: a file whose hash is wrong)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.debian import ensure_tool
from tests.support.sidecar import Proc, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
MOTO_VENV = REPO / ".cache" / "tools" / "moto"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FileServer:
    """Files over HTTP/1.1 on 127.0.0.1 with Range, ETag and queued faults; counts the body bytes it sent."""

    def __init__(
        self, files: dict[str, bytes] | None = None, token: str | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.files = dict(files or {})
        self.token = token
        self.faults: dict[str, list[str]] = defaultdict(list)
        self.sent = 0
        self.gets: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.stalls: list[threading.Event] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                server.handle(self, head=True)

            def do_GET(self) -> None:
                server.handle(self, head=False)

        self.httpd = ThreadingHTTPServer((host, free_port()), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self) -> None:
        for stall in self.stalls:
            stall.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def fault(self, name: str, *faults: str) -> None:
        self.faults[name].extend(faults)

    # ---- requests --------------------------------------------------------------------------------------------
    def authorized(self, request: BaseHTTPRequestHandler) -> bool:
        if self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}":
            return True
        self.reply(request, 401, b'{"error": "Invalid credentials in Authorization header"}', "application/json")
        return False

    def handle(self, request: BaseHTTPRequestHandler, head: bool) -> None:
        if not self.authorized(request):
            return
        name = request.path.lstrip("/").split("?")[0]
        if name not in self.files:
            self.reply(request, 404, b'{"error": "Entry not found"}', "application/json")
            return
        self.send_file(
            request, name, self.files[name], head, {"ETag": f'"{hashlib.sha256(self.files[name]).hexdigest()}"'}
        )

    def reply(self, request: BaseHTTPRequestHandler, status: int, body: bytes, kind: str, headers=None) -> None:
        request.send_response(status)
        for key, value in {"Content-Type": kind, "Content-Length": str(len(body)), **(headers or {})}.items():
            request.send_header(key, value)
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(body)

    def send_file(self, request, name: str, data: bytes, head: bool, headers: dict[str, str]) -> None:
        fault = None
        if not head:
            with self.lock:
                self.gets[name] += 1
                if self.faults[name] and self.faults[name][0] != "corrupt":
                    fault = self.faults[name].pop(0)
            if fault == "5xx":
                self.reply(request, 503, b'{"error": "Service Unavailable"}', "application/json")
                return
            if "corrupt" in self.faults[name]:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        ranged = request.headers.get("Range")
        if ranged and not head:
            start = int(ranged.split("=")[1].split("-")[0])
        body = data[start:]
        request.send_response(206 if start else 200)
        request.send_header("Content-Length", str(len(body) if not head else len(data)))
        request.send_header("Accept-Ranges", "bytes")
        request.send_header("Content-Type", "application/octet-stream")
        if start:
            request.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        for key, value in headers.items():
            request.send_header(key, value)
        request.end_headers()
        if head:
            return
        cut = {"stall": len(body) // 2, "drop": len(body) // 2, "truncate": len(body) - 7}.get(fault or "", len(body))
        self._write(request, body[:cut])
        if fault == "stall":
            stall = threading.Event()
            self.stalls.append(stall)
            stall.wait(60)  # silence: the client's read timeout is the only way out
        if fault in ("stall", "drop", "truncate"):
            request.close_connection = True
            with_socket = request.connection
            with_socket.shutdown(socket.SHUT_RDWR)

    def _write(self, request, body: bytes) -> None:
        view = memoryview(body)
        for offset in range(0, len(view), 1 << 20):
            try:
                request.wfile.write(view[offset : offset + (1 << 20)])
            except (BrokenPipeError, ConnectionResetError):
                return
            with self.lock:
                self.sent += min(1 << 20, len(view) - offset)


class HubServer(FileServer):
    """One or more hub repositories: `repos[repo_id] = {filename: bytes}`, at one commit each; *.safetensors are
    LFS files (the hub's ETag is their sha256), the rest plain git blobs (ETag: the blob id)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], token: str | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(token=token, host=host)
        self.repos = repos
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.hashes = {  # what the hub stores beside each file: computed once, not per request
            (repo, name): (hashlib.sha256(data).hexdigest(), git_blob_sha1(data))
            for repo, files in repos.items()
            for name, data in files.items()
        }

    def handle(self, request: BaseHTTPRequestHandler, head: bool) -> None:
        import json

        if not self.authorized(request):
            return
        path = request.path.split("?")[0].lstrip("/")
        if path.startswith("api/models/"):
            repo, _, revision = path[len("api/models/") :].partition("/revision/")
            revision = revision or "main"
            if repo not in self.repos or revision not in ("main", self.commits[repo]):
                self.reply(request, 404, b'{"error": "Repository not found"}', "application/json",
                           {"X-Error-Code": "RepoNotFound"})  # fmt: skip
                return
            siblings = []
            for name, data in self.repos[repo].items():
                sha256, blob_id = self.hashes[(repo, name)]
                entry = {"rfilename": name, "size": len(data), "blobId": blob_id}
                if name.endswith(".safetensors"):
                    entry["lfs"] = {"sha256": sha256, "size": len(data), "pointerSize": 134}
                siblings.append(entry)
            body = {"id": repo, "modelId": repo, "sha": self.commits[repo], "siblings": siblings, "private": False}
            self.reply(request, 200, json.dumps(body).encode(), "application/json")
            return
        # ORG/NAME/resolve/REVISION/FILE
        parts = path.split("/")
        repo, revision, name = "/".join(parts[:2]), parts[3] if len(parts) > 3 else "", "/".join(parts[4:])
        files = self.repos.get(repo, {}) if revision in ("main", self.commits.get(repo)) else {}
        if len(parts) < 5 or parts[2] != "resolve" or name not in files:
            self.reply(request, 404, b'{"error": "Entry not found"}', "application/json",
                       {"X-Error-Code": "EntryNotFound"})  # fmt: skip
            return
        data = files[name]
        sha256, blob_id = self.hashes[(repo, name)]
        etag = sha256 if name.endswith(".safetensors") else blob_id
        self.send_file(
            request, f"{repo}/{name}", data, head, {"ETag": f'"{etag}"', "X-Repo-Commit": self.commits[repo]}
        )

    def fault(self, name: str, *faults: str) -> None:
        super().fault(name, *faults)  # name: "ORG/NAME/FILE"


def ensure_moto() -> Path:
    """moto's S3 server in its own venv under .cache/tools (created once, from PyPI)."""
    server = MOTO_VENV / "bin" / "moto_server"
    if not server.exists():
        shutil.rmtree(MOTO_VENV, ignore_errors=True)
        subprocess.run(["python3", "-m", "venv", str(MOTO_VENV)], check=True)
        subprocess.run([str(MOTO_VENV / "bin" / "pip"), "install", "-q", "moto[server]==5.2.5"], check=True)
    return server


class MotoServer:
    """`moto_server` on 127.0.0.1 (S3 with any credentials), stopped by its PID."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        self.proc = Proc([str(ensure_moto()), "-H", "127.0.0.1", "-p", str(self.port)], workdir / "moto.log", env)
        wait_until(lambda: socket.create_connection(("127.0.0.1", self.port), timeout=1).close() or True, 60,
                   "moto_server to listen", self.proc)  # fmt: skip

    def stop(self) -> None:
        self.proc.stop()


class RegistryServer:
    """Debian's `docker-registry` on 127.0.0.1 (storage in `workdir`), stopped by its PID; `blob_file` is where it
    keeps a blob, for a test that damages one."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1") -> None:
        ensure_tool("docker-registry", "docker-registry")
        self.port = free_port()
        self.host = f"{host}:{self.port}"
        self.storage = workdir / "registry"
        config = workdir / "registry.yml"
        config.write_text(
            "version: 0.1\nlog: {level: error}\n"
            f"storage: {{filesystem: {{rootdirectory: {self.storage}}}}}\nhttp: {{addr: {self.host}}}\n"
        )
        self.proc = Proc(["docker-registry", "serve", str(config)], workdir / "registry.log")
        wait_until(lambda: urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).status == 200, 30,
                   "docker-registry to answer /v2/", self.proc)  # fmt: skip

    def blob_file(self, digest: str) -> Path:
        hex_digest = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"

    def stop(self) -> None:
        self.proc.stop()


class RegistryProxy(FileServer):
    """The registry's API passed through, with FileServer's faults on blobs (queued per digest, `sha256:HEX`)."""

    def __init__(self, registry: RegistryServer) -> None:
        super().__init__()
        self.upstream = f"http://{registry.host}"
        self.host = self.url.removeprefix("http://")

    def handle(self, request: BaseHTTPRequestHandler, head: bool) -> None:
        accept = {"Accept": request.headers["Accept"]} if request.headers.get("Accept") else {}
        forwarded = urllib.request.Request(self.upstream + request.path, method="HEAD" if head else "GET",
                                           headers=accept)  # fmt: skip
        try:
            response = urllib.request.urlopen(forwarded, timeout=30)
        except urllib.error.HTTPError as error:
            response = error
        body = response.read()
        passed = {k: v for k, v in response.headers.items() if k in ("Docker-Content-Digest", "Content-Type")}
        digest = request.path.rsplit("/blobs/", 1)[1] if "/blobs/" in request.path else None
        if digest and response.status == 200:
            self.send_file(request, digest, body, head, passed)
        else:
            self.reply(request, response.status, body, passed.pop("Content-Type", "application/json"), passed)
