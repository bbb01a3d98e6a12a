"""The operator tests' cluster: a Kubernetes API (kmock + tests.support.kube) on 127.0.0.1, a kubeconfig for it,
the real kubectl from .tools/bin, and `overlap operator` running against it as a subprocess.

Everything is started on free ports and stopped by PID at the end of the module that used it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.support.kube import ApiServer

REPO = Path(__file__).resolve().parents[2]
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
CRD_FILE = REPO / "crds" / "inferenceservices.overlap.dev.yaml"
NAMESPACE = "overlap-test"


class ApiThread:
    """The emulated API server on its own event loop in a background thread (tests stay synchronous)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="kube-api", daemon=True)
        self.thread.start()
        if not self.ready.wait(15):
            raise RuntimeError("the emulated Kubernetes API did not start")

    async def _serve(self) -> None:
        import kmock

        self.loop = asyncio.get_running_loop()
        self.stop = asyncio.Event()
        async with ApiServer() as api, kmock.Server(api, host="127.0.0.1") as server:
            self.api, self.url = api, f"http://127.0.0.1:{server.port}"
            self.ready.set()
            await self.stop.wait()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


class Cluster:
    """What a test talks to: kubectl, the kubernetes client, and the harness's stand-ins for controllers."""

    def __init__(self, api_thread: ApiThread, kubeconfig: Path) -> None:
        import kubernetes

        self.api = api_thread.api
        self.api_loop = api_thread.loop
        self.url = api_thread.url
        self.kubeconfig = kubeconfig
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.apps = kubernetes.client.AppsV1Api(self.client)
        self.policy = kubernetes.client.PolicyV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)

    def end_watches(self) -> int:
        """Cut every open watch stream (see ApiServer.end_watches); returns how many."""
        return self.api.end_watches(self.api_loop)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """The real kubectl (never the one on PATH) against the emulated API."""
        cmd = [str(KUBECTL), "--kubeconfig", str(self.kubeconfig), *args]
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def apply(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """`kubectl apply` as a user types it: kubectl sees (OpenAPI v3) that the server validates fields and sends
        `fieldValidation=Strict`; the emulator validates custom resources (tests.support.kube.admission)."""
        return self.kubectl("apply", *args, stdin=stdin, check=check)

    def get(self, kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any] | None:
        """One object as JSON (None when absent), read through kubectl."""
        done = self.kubectl("get", kind, name, "-n", namespace, "-o", "yaml", check=False)
        if done.returncode != 0:
            if "NotFound" in done.stderr or "not found" in done.stderr:
                return None
            raise AssertionError(done.stderr)
        return yaml.safe_load(done.stdout)

    def service(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("overlap.dev", "v1alpha1", namespace, "inferenceservices", name)

    def play_deployment_controller(self, name: str, ready: int | None = None, namespace: str = NAMESPACE) -> None:
        """Do what the Deployment controller would: report the pods as created, updated and (some) ready."""
        deployment = self.apps.read_namespaced_deployment(name, namespace)
        replicas = deployment.spec.replicas
        ready = replicas if ready is None else ready
        status = {
            "observedGeneration": deployment.metadata.generation,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        self.apps.patch_namespaced_deployment_status(name, namespace, {"status": status})


def wait_for(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition", interval: float = 0.1
) -> Any:
    """Poll until `predicate()` is truthy; its value, or AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the object may not exist yet
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}" + (f" (last error: {last_error})" if last_error else "")
    )


OPERATOR_TOKEN = "operator-token"  # the operator's identity in the API's request log (RBAC checks)


def operator_requests(cluster: Cluster) -> set[tuple[str, str, str, str | None]]:
    """(verb, API group, resource[/subresource], object name or None) of every request the operator made, from the
    API's log."""
    verbs = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}
    used = set()
    for request in list(cluster.api.request_log):
        if request.headers.get("Authorization") != f"Bearer {OPERATOR_TOKEN}" or request.resource is None:
            continue
        if not request.resource.plural:
            continue  # discovery: allowed to every authenticated user
        method = str(request.method.value).upper()
        if method == "GET":
            verb = "watch" if request.params.get("watch") == "true" else "get" if request.name else "list"
        else:
            verb = verbs[method]
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        used.add((verb, request.resource.group, resource, request.name if verb != "create" else None))
        if id(request) in cluster.api.applies_that_created:
            used.add(("create", request.resource.group, resource, None))  # an apply that creates needs both verbs
    return used


def chart_grants() -> set[tuple[str, str, str, str | None]]:
    """(verb, API group, resource, name or None for any) that the chart's ClusterRole grants the operator (rendered
    by the real helm)."""
    helm = [str(REPO / ".tools" / "bin" / "helm"), "template", "overlap", str(REPO / "charts" / "overlap")]
    docs = yaml.safe_load_all(subprocess.run(helm, capture_output=True, text=True, check=True).stdout)
    (role,) = [d for d in docs if d and d["kind"] == "ClusterRole" and d["metadata"]["name"] == "overlap"]
    return {(verb, group, resource, name) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]
            for name in rule.get("resourceNames") or [None]}  # fmt: skip


def not_granted(used: set[tuple], granted: set[tuple]) -> set[tuple]:
    """The requests of `used` no rule of `granted` allows (RBAC: a rule with resourceNames allows those names only)."""
    return {u for u in used if u not in granted and (*u[:3], None) not in granted}


def unused_grants(used: set[tuple], granted: set[tuple]) -> set[tuple]:
    """The (verb, group, resource, name) of `granted` that no request of `used` needed."""
    return {g for g in granted if not any(u[:3] == g[:3] and g[3] in (None, u[3]) for u in used)}


def write_kubeconfig(path: Path, url: str, namespace: str, token: str = "test-token") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulated", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [
            {"name": "emulated", "context": {"cluster": "emulated", "user": "tester", "namespace": namespace}}
        ],
        "current-context": "emulated",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path, *args: str) -> None:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self.log_file = log_path.open("w")
        cmd = [str(REPO / ".venv" / "bin" / "overlap"), "--log-level", "DEBUG", "operator", *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_file, stderr=subprocess.STDOUT, cwd="/")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log_file.close()


@contextlib.contextmanager
def running_operator(cluster: Cluster, folder: Path, *args: str) -> Iterator[OperatorProcess]:
    """`overlap operator ARGS` against the emulated API, with its own identity (token) and log file."""
    kubeconfig = write_kubeconfig(folder / "kubeconfig", cluster.url, NAMESPACE, token=OPERATOR_TOKEN)
    proc = OperatorProcess(kubeconfig, folder / "operator.log", *args)
    try:
        wait_for(
            lambda: proc.proc.poll() is not None or "Starting the watch" in proc.log(),
            timeout=30,
            what="the operator to start watching",
        )
        if proc.proc.poll() is not None:
            raise AssertionError(f"the operator exited:\n{proc.log()[-4000:]}")
        yield proc
    finally:
        proc.stop()
