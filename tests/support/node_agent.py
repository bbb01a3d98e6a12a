"""A node agent for one machine: what kubelet and kube-proxy do for the operator's Deployments, with podman.

It polls the (emulated) API server and runs each replica of every Deployment in its namespace as a real pod: a
podman pod (one network namespace, one IP on podman's bridge) with one container per entry of the pod template,
taking the template's image, command, args, env (values, Secret and ConfigMap keys, the pod's own name and IP),
volumes (emptyDir; ConfigMap and Secret folders kept up to date as kubelet does, through a `..data` symlink;
hostPath; image volumes, read-only from local storage), securityContext (user, group, fsGroup, read-only root,
capabilities, no-new-privileges) and CPU and memory limits. It runs the startup, readiness and liveness probes
itself (HTTP GET on the pod IP, or exec in the container; as kubelet does, the other two wait until the startup
probe has passed, and a container is not ready before then), restarts a container that exits or fails its startup or
liveness probe (with kubelet's back-off), and removes a pod as kubelet does: not ready at once, then every
container's preStop hook, SIGTERM, and SIGKILL at the end of the grace period. It writes the Pod objects (IP, phase,
conditions, container states such as ErrImagePull or CrashLoopBackOff) and the Deployment's status from what really
runs. Each Service gets a round-robin TCP proxy on 127.0.0.1 over its ready pods (kube-proxy), following its
selector as it changes, and a second one on the bridge's gateway at the Service's own port, which pods reach by the
Service's DNS name (`NAME.NAMESPACE.svc`, written into every pod's /etc/hosts: cluster DNS). A headless Service
(clusterIP None) gets no proxy: its name resolves to each of its ready pods' IPs, as CoreDNS answers, kept up to
date in every pod's /etc/hosts (rewritten in place, as the file is bind-mounted). Every pod with an IP is
a target in a Prometheus file-based discovery file, labelled with its InferenceService as a pod-role scrape relabels
it.

It also plays kube-scheduler for its one node: a pod that asks for more GPUs than the node has (none: podman runs
no GPU), whose nodeSelector the node's labels do not match, or whose PersistentVolumeClaim does not exist or is not
bound stays Pending with PodScheduled False (Unschedulable, in the scheduler's words), and is retried at every pass as
the scheduler would. CPU and memory are not counted: the host is smaller than the nodes the examples are sized for.

Limits, by design: one namespace; no ReplicaSets (pods belong to the Deployment); no image pulls (images must be in
podman's local storage, `make images`), so a missing image is ErrImagePull at once; rollouts follow the Deployment
strategy's maxSurge and maxUnavailable; Services share the gateway's address, so two with the same port are not both
reachable from pods (the first one is). Everything it starts it removes by id on `stop()`, and a new agent first
removes the pods an earlier one left behind (found by label).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

log = logging.getLogger("node-agent")

AGENT_LABEL = "dev.overlap.node-agent"
NODE_NAME = "podman-node"
SYNC_S = 0.5
# podman on this kind of machine needs runc (crun fails on hybrid cgroups) and explicit ulimits (the defaults are
# refused); a containers.conf says so for every podman call the agent makes.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
"""
BACKOFF_S = (0, 10, 20, 40, 80, 160, 300)  # kubelet's restart back-off, by restarts so far
HEADLESS_MARK = "# headless Services (node agent)\n"  # in a pod's /etc/hosts, above their lines
INSTANCE_LABEL = "overlap.dev/inferenceservice"  # a pod's service, as the Prometheus relabelling would name it
GPU = "nvidia.com/gpu"
# kube-scheduler's FitError, for one node: what filtered it out, then what its preemption found.
UNSCHEDULABLE = (
    "0/1 nodes are available: {}. preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling."
)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def cpu_quantity(value: str) -> float:
    value = str(value)
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def memory_bytes(value: str) -> int:
    value = str(value)
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return int(float(value[: -len(suffix)]) * factor)
    return int(value)


class PodmanError(RuntimeError):
    pass


class Podman:
    """The podman command line, with this machine's runtime settings."""

    def __init__(self, workdir: Path) -> None:
        conf = workdir / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        done = subprocess.run(["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and done.returncode != 0:
            raise PodmanError(f"podman {args[0]}: {(done.stderr or done.stdout).strip()}")
        return done.stdout.strip()

    def logs(self, container_id: str) -> str:
        """A container's output, its stdout and stderr interleaved as it wrote them (podman logs splits them)."""
        done = subprocess.run(["podman", "logs", container_id], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=self.env, timeout=120)  # fmt: skip
        return done.stdout

    def succeeds(self, *args: str, timeout: float = 120) -> bool:
        """Whether `podman ARGS` exits 0 within `timeout` seconds (a question, not a step that must work)."""
        try:
            done = subprocess.run(["podman", *args], capture_output=True, env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def state(self, container_id: str) -> dict[str, Any]:
        out = self("inspect", "--format", "{{json .State}}", container_id, check=False)
        return json.loads(out) if out else {"Status": "missing", "ExitCode": -1}


@dataclass
class Probe:
    """An HTTP GET probe (`path`, `port`) or an exec probe (`command`), with kubelet's period and thresholds."""

    path: str | None
    port: int | None
    command: list[str] | None
    period_s: float
    failure_threshold: int
    initial_delay_s: float
    timeout_s: float
    failures: int = 0
    next_at: float = 0.0

    @classmethod
    def parse(cls, probe: dict | None, ports: dict[str, int]) -> Probe | None:
        if not probe or not ("httpGet" in probe or "exec" in probe):
            return None
        port = probe["httpGet"]["port"] if "httpGet" in probe else None
        return cls(
            path=probe["httpGet"].get("path", "/") if "httpGet" in probe else None,
            port=ports[port] if isinstance(port, str) else None if port is None else int(port),
            command=list(probe["exec"]["command"]) if "exec" in probe else None,
            period_s=probe.get("periodSeconds", 10),
            failure_threshold=probe.get("failureThreshold", 3),
            initial_delay_s=probe.get("initialDelaySeconds", 0),
            timeout_s=probe.get("timeoutSeconds", 1),
        )

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def check(self, ip: str, now: float, run: Callable[[list[str], float], bool]) -> bool | None:
        """True/False once the failure threshold decides; None when this probe changes nothing. `run(command,
        timeout)` runs an exec probe's command in the container."""
        self.next_at = now + self.period_s
        if self.command is not None:
            ok = run(self.command, self.timeout_s)
        else:
            try:
                with urllib.request.urlopen(f"http://{ip}:{self.port}{self.path}", timeout=self.timeout_s) as reply:
                    ok = 200 <= reply.status < 400
            except (OSError, urllib.error.URLError):
                ok = False
        if ok:
            self.failures = 0
            return True
        self.failures += 1
        return False if self.failures >= self.failure_threshold else None


@dataclass
class Container:
    spec: dict[str, Any]
    id: str | None = None
    image_id: str = ""
    running: bool = False
    ready: bool = False
    started_at: str | None = None
    restarts: int = 0
    waiting: tuple[str, str] | None = ("ContainerCreating", "")  # (reason, message) while it does not run
    last_exit: dict[str, Any] | None = None
    retry_at: float = 0.0
    startup: Probe | None = None
    started: bool = False  # the startup probe passed (or there is none)
    readiness: Probe | None = None
    liveness: Probe | None = None
    completed: bool = False  # an init container that exited 0
    message_file: Path | None = None  # its terminationMessagePath on the host

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class Pod:
    name: str
    deployment: str
    template_hash: str
    template: dict[str, Any]
    dir: Path
    created: float = field(default_factory=time.time)
    pod_id: str | None = None
    ip: str | None = None
    containers: list[Container] = field(default_factory=list)
    init_containers: list[Container] = field(default_factory=list)
    volumes: dict[str, tuple[Path, bool]] = field(default_factory=dict)  # name -> (host path, read-only)
    image_volumes: dict[str, str] = field(default_factory=dict)  # name -> image reference
    volume_versions: dict[str, str] = field(default_factory=dict)
    problem: tuple[str, str] | None = None  # a pod-level failure, e.g. a volume that cannot be set up
    unschedulable: str | None = None  # why the scheduler has not placed it (None: placed on this node)
    terminating: bool = False
    gone: bool = False
    written: str = ""  # the last status written, to skip unchanged writes
    hosts_file: str | None = None  # podman's /etc/hosts of the pod, on the host
    dns_written: str | None = None  # the headless Services' lines last written into it

    @property
    def labels(self) -> dict[str, str]:
        return self.template.get("metadata", {}).get("labels", {})

    @property
    def ready(self) -> bool:
        return not self.terminating and bool(self.containers) and all(c.ready for c in self.containers)

    def port(self, name_or_number: str | int) -> int | None:
        if isinstance(name_or_number, int):
            return name_or_number
        for container in self.containers:
            for port in container.spec.get("ports", []):
                if port.get("name") == name_or_number:
                    return port["containerPort"]
        return None


class NodeAgent:
    """kubelet and kube-proxy for the Deployments of one namespace (see the module's docstring)."""

    def __init__(
        self,
        api_client,
        namespace: str,
        workdir: Path,
        *,
        sd_file: Path | None = None,
        proxy_ports: dict[str, int] | None = None,
        gpus: int = 0,
        node_labels: dict[str, str] | None = None,
    ) -> None:
        """`proxy_ports` pins a Service's proxy to a port known in advance (otherwise a free one is taken); `gpus`
        and `node_labels` are what the node offers the scheduler (its `nvidia.com/gpu` and its labels)."""
        import kubernetes

        self.namespace = namespace
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.apps = kubernetes.client.AppsV1Api(api_client)
        self.podman = Podman(self.workdir)
        self.sd_file = sd_file
        self.proxy_ports = dict(proxy_ports or {})
        self.gpus = gpus
        self.node_labels = {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux", **(node_labels or {})}
        self.pods: dict[str, Pod] = {}
        self.proxies: dict[str, ServiceProxy] = {}  # on 127.0.0.1, for the test
        self.pod_proxies: dict[str, ServiceProxy] = {}  # on the bridge's gateway, for pods (cluster DNS)
        self.selectors: dict[str, dict[str, str]] = {}  # each Service's selector as last read
        self.gateway = self._gateway()
        self.events: list[str] = []  # what happened, for a report
        self.terminations: list[dict[str, Any]] = []  # per removed pod: seconds taken, exit codes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-agent", daemon=True)
        self._terminators: list[threading.Thread] = []
        self._deployment_written: dict[str, str] = {}
        self.remove_leftovers()

    # ---- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing, then remove every pod this agent started (by id) and close the proxies."""
        self._stop.set()
        self._thread.join(30)
        for thread in self._terminators:
            thread.join(0)
        for pod in list(self.pods.values()):
            if pod.pod_id:
                self.podman("pod", "rm", "--force", "--time", "2", pod.pod_id, check=False)
            shutil.rmtree(pod.dir, ignore_errors=True)
        self.pods.clear()
        for proxy in [*self.proxies.values(), *self.pod_proxies.values()]:
            proxy.close()
        self.proxies.clear()
        self.pod_proxies.clear()

    def remove_leftovers(self) -> None:
        """Pods an earlier agent for this namespace left behind (killed before its stop()), found by label."""
        mine = f"label={AGENT_LABEL}={self.namespace}"
        for pod_id in self.podman("pod", "ps", "--quiet", "--filter", mine, check=False).split():
            self.podman("pod", "rm", "--force", "--time", "0", pod_id, check=False)

    def container_log(self, pod_name: str, container: str | None) -> str:
        """A container's log, as kubelet serves `pods/log` (the first container when none is named)."""
        pod = self.pods.get(pod_name)
        if pod is None:
            return ""
        every = [*pod.init_containers, *pod.containers]
        chosen = next((c for c in every if c.name == container), None) if container else pod.containers[0]
        return self.podman.logs(chosen.id) if chosen is not None and chosen.id else ""

    def note(self, message: str) -> None:
        log.info(message)
        self.events.append(f"{now_iso()} {message}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # an API hiccup must not take the node down; the next pass retries
                log.exception("node agent sync failed")
            self._stop.wait(SYNC_S)

    def service_address(self, name: str, timeout: float = 60) -> tuple[str, int]:
        """Where the Service's proxy listens (waits for the agent to open it)."""
        deadline = time.monotonic() + timeout
        while name not in self.proxies:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the node agent opened no proxy for Service {name}")
            time.sleep(0.1)
        return "127.0.0.1", self.proxies[name].port

    def wait_for_terminations(self, timeout: float) -> None:
        for thread in list(self._terminators):
            thread.join(timeout)

    # ---- one pass ------------------------------------------------------------------------------------------------
    def sync(self) -> None:
        deployments = self._list(self.apps.list_namespaced_deployment)
        live = {d["metadata"]["name"] for d in deployments}
        for deployment in deployments:
            self._sync_deployment(deployment)
        objects = {p["metadata"]["name"] for p in self._list(self.core.list_namespaced_pod)}
        for pod in list(self.pods.values()):
            if pod.gone:
                del self.pods[pod.name]
            elif (pod.deployment not in live or pod.name not in objects) and not pod.terminating:
                self._terminate(pod)  # its Deployment went, or its Pod object (the garbage collector, kubectl)
        configmaps = {c["metadata"]["name"]: c for c in self._list(self.core.list_namespaced_config_map)}
        for pod in list(self.pods.values()):
            if pod.unschedulable and not pod.terminating:
                self._schedule(pod)
            if not pod.terminating:
                self._refresh_volumes(pod, configmaps)
                self._tend_containers(pod)
                self._write_pod(pod)
        for deployment in deployments:
            self._write_deployment_status(deployment)
        services = self._sync_services()
        self._write_headless_dns(services)
        self._write_service_discovery()

    def _gateway(self) -> str:
        """The podman bridge's gateway: the host, as the pods reach it."""
        gateway = self.podman("network", "inspect", "podman", "--format", "{{(index .Subnets 0).Gateway}}", check=False)
        return gateway.strip() or "10.88.0.1"

    def _list(self, method) -> list[dict[str, Any]]:
        return json.loads(method(self.namespace, _preload_content=False).data)["items"]

    def _secret(self, name: str) -> dict[str, str] | None:
        try:
            secret = json.loads(self.core.read_namespaced_secret(name, self.namespace, _preload_content=False).data)
        except Exception:  # kubernetes.client.ApiException, 404 above all
            return None
        return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}

    # ---- the Deployment controller's part ------------------------------------------------------------------------
    def _sync_deployment(self, deployment: dict[str, Any]) -> None:
        name = deployment["metadata"]["name"]
        template = deployment["spec"]["template"]
        template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        desired = deployment["spec"].get("replicas", 1)
        mine = [p for p in self.pods.values() if p.deployment == name and not p.terminating]
        current = [p for p in mine if p.template_hash == template_hash]
        old = [p for p in mine if p.template_hash != template_hash]
        if old:  # a rollout, within the strategy's maxSurge and maxUnavailable
            surge, unavailable = rolling_limits(deployment["spec"].get("strategy") or {}, desired)
            if len(current) < desired and len(mine) < desired + surge:
                self._create_pod(deployment, template_hash)
            unready_old = [p for p in old if not p.ready]
            if unready_old:
                self._terminate(unready_old[0])
            elif sum(p.ready for p in mine) - 1 >= desired - unavailable:
                self._terminate(old[0])
            return
        for _ in range(desired - len(current)):
            self._create_pod(deployment, template_hash)
        # Scale down as the ReplicaSet controller ranks pods: not ready ones first, then the newest.
        for pod in sorted(current, key=lambda p: (p.ready, -p.created))[: max(0, len(current) - desired)]:
            self._terminate(pod)

    def _write_deployment_status(self, deployment: dict[str, Any]) -> None:
        name = deployment["metadata"]["name"]
        template_hash = hashlib.sha256(json.dumps(deployment["spec"]["template"], sort_keys=True).encode()).hexdigest()
        pods = [p for p in self.pods.values() if p.deployment == name and not p.terminating]
        desired = deployment["spec"].get("replicas", 1)
        ready = sum(p.ready for p in pods)
        updated = sum(p.template_hash == template_hash[:10] for p in pods)
        available = ready >= desired
        complete = updated == desired == len(pods) and ready == desired
        status = {
            "observedGeneration": deployment["metadata"].get("generation"),
            "replicas": len(pods),
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, len(pods) - ready),
            "conditions": [
                {"type": "Available", "status": str(available), "reason": "MinimumReplicasAvailable" if available
                 else "MinimumReplicasUnavailable", "message": f"{ready} of {desired} replicas available"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable" if complete
                 else "ReplicaSetUpdated", "message": f"{updated} updated, {ready} ready of {desired}"},
            ],
        }  # fmt: skip
        text = json.dumps(status, sort_keys=True)
        if self._deployment_written.get(name) != text:
            self.apps.patch_namespaced_deployment_status(
                name, self.namespace, {"status": status}, _preload_content=False
            )
            self._deployment_written[name] = text

    # ---- pods ----------------------------------------------------------------------------------------------------
    def _create_pod(self, owner: dict[str, Any], template_hash: str) -> None:
        deployment, template = owner["metadata"]["name"], owner["spec"]["template"]
        name = f"{deployment}-{template_hash[:6]}-{secrets.token_hex(3)}"
        pod = Pod(name, deployment, template_hash, template, self.workdir / "pods" / name)
        pod.containers = [Container(spec) for spec in template["spec"]["containers"]]
        pod.init_containers = [Container(spec) for spec in template["spec"].get("initContainers", [])]
        self.pods[name] = pod
        self.note(f"pod {name}: created for Deployment {deployment}")
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": pod.labels,
                "annotations": template.get("metadata", {}).get("annotations", {}),
                "ownerReferences": [
                    # The Deployment, not a ReplicaSet (the agent has none): the garbage collector takes the pods
                    # with it, and would delete a pod that names an owner that does not exist.
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": deployment,
                        "uid": owner["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": dict(template["spec"]),
        }
        self.core.create_namespaced_pod(self.namespace, body, _preload_content=False)
        self._schedule(pod)

    # ---- kube-scheduler's part -----------------------------------------------------------------------------------
    def _schedule(self, pod: Pod) -> None:
        """Bind the pod to this node and set it up, or leave it Pending with the scheduler's reason."""
        why = self._unfit(pod.template["spec"])
        if why is not None:
            if why != pod.unschedulable:
                self.note(f"pod {pod.name}: unschedulable: {why}")
            pod.unschedulable = why
            return
        pod.unschedulable = None
        # (kube-scheduler binds through the pods/binding subresource; the emulator takes the field as a patch)
        self.core.patch_namespaced_pod(pod.name, self.namespace, {"spec": {"nodeName": NODE_NAME}},
                                       _preload_content=False)  # fmt: skip
        self._set_up_pod(pod)

    def _unfit(self, spec: dict[str, Any]) -> str | None:
        """Why this node cannot take a pod of `spec`, in kube-scheduler's words; None when it fits. Claims are
        checked first, as the scheduler's PreFilter does; then the node's GPUs and labels."""
        for volume in spec.get("volumes", []):
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is None:
                continue
            try:
                found = self.core.read_namespaced_persistent_volume_claim(claim, self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return UNSCHEDULABLE.format(f'persistentvolumeclaim "{claim}" not found')
            if (found.status.phase if found.status else None) != "Bound":
                return UNSCHEDULABLE.format("pod has unbound immediate PersistentVolumeClaims")
        reasons = []
        asked = sum(int(((c.get("resources") or {}).get("limits") or {}).get(GPU, 0)) for c in spec["containers"])
        if asked > self.gpus:
            reasons.append(f"1 Insufficient {GPU}")
        if any(self.node_labels.get(key) != value for key, value in (spec.get("nodeSelector") or {}).items()):
            reasons.append("1 node(s) didn't match Pod's node affinity/selector")
        return UNSCHEDULABLE.format(", ".join(sorted(reasons))) if reasons else None

    def _set_up_pod(self, pod: Pod) -> None:
        """Volumes and the podman pod (one network namespace) of a pod placed here."""
        name = pod.name
        try:
            self._set_up_volumes(pod)
            # Cluster DNS: every Service's name resolves to the gateway, where its pod-facing proxy listens.
            hosts = []
            for service in self._list(self.core.list_namespaced_service):
                if service["spec"].get("clusterIP") == "None":
                    continue  # its pods' addresses: _write_headless_dns
                svc = f"{service['metadata']['name']}.{self.namespace}.svc"
                hosts += ["--add-host", f"{svc}:{self.gateway}", "--add-host", f"{svc}.cluster.local:{self.gateway}"]
            pod.pod_id = self.podman(
                "pod", "create", "--name", f"{self.namespace}-{name}", "--label", f"{AGENT_LABEL}={self.namespace}",
                "--network", "podman", *hosts,
            )  # fmt: skip
        except (PodmanError, OSError) as exc:
            pod.problem = ("FailedCreatePodSandBox", str(exc))
            self.note(f"pod {name}: {exc}")

    def _set_up_volumes(self, pod: Pod) -> None:
        pod.dir.mkdir(parents=True, exist_ok=True)
        for volume in pod.template["spec"].get("volumes", []):
            name = volume["name"]
            if "emptyDir" in volume:
                medium = volume["emptyDir"].get("medium")
                # Memory: a folder on the host's tmpfs, so every container of the pod shares it, as on a node.
                base = Path("/dev/shm") / f"overlap-agent-{os.getpid()}" / pod.name if medium == "Memory" else pod.dir
                path = base / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o777)  # kubelet's mode for an emptyDir
                pod.volumes[name] = (path, False)
            elif "hostPath" in volume:
                path, kind = Path(volume["hostPath"]["path"]), volume["hostPath"].get("type", "")
                if kind == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                if kind in ("Directory", "DirectoryOrCreate") and not path.is_dir():
                    raise OSError(f'MountVolume.SetUp failed for volume "{name}": hostPath type check failed: '
                                  f"{path} is not a directory")  # fmt: skip
                pod.volumes[name] = (path, False)
            elif "configMap" in volume or "secret" in volume:
                path = pod.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o755)
                pod.volumes[name] = (path, True)
            elif "image" in volume:
                reference = volume["image"]["reference"]
                if not self._image_exists(reference):
                    raise OSError(f'MountVolume.SetUp failed for volume "{name}": image "{reference}" is not in this '
                                  "node's image storage and the node agent never pulls")  # fmt: skip
                pod.image_volumes[name] = reference
            else:
                kinds = ", ".join(k for k in volume if k != "name")
                raise OSError(f'volume "{name}" ({kinds}): this node agent mounts emptyDir, configMap, secret, '
                              "hostPath and image only")  # fmt: skip

    def _refresh_volumes(self, pod: Pod, configmaps: dict[str, dict]) -> None:
        """ConfigMap and Secret volumes, written as kubelet's atomic writer does and rewritten when they change."""
        if pod.problem or pod.unschedulable:
            return
        for volume in pod.template["spec"].get("volumes", []):
            if "configMap" in volume:
                source = volume["configMap"]
                data = (configmaps.get(source["name"]) or {}).get("data")
            elif "secret" in volume:
                source = volume["secret"]
                data = self._secret(source["secretName"])
            else:
                continue
            if data is None:
                kind = "configmap" if "configMap" in volume else "secret"
                missing = source.get("name") or source.get("secretName")
                for c in pod.containers:
                    if c.id is None:
                        c.waiting = ("ContainerCreating", f'MountVolume.SetUp failed: {kind} "{missing}" not found')
                continue
            files = {item["path"]: data[item["key"]] for item in source["items"] if item["key"] in data} if (
                source.get("items")) else dict(data)  # fmt: skip
            version = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
            if pod.volume_versions.get(volume["name"]) != version:
                write_atomic_volume(pod.volumes[volume["name"]][0], files, version)
                pod.volume_versions[volume["name"]] = version

    def _volumes_ready(self, pod: Pod) -> bool:
        wanted = [v["name"] for v in pod.template["spec"].get("volumes", []) if "configMap" in v or "secret" in v]
        return all(name in pod.volume_versions for name in wanted)

    def _container_args(self, pod: Pod, container: Container) -> list[str]:
        pod_spec, spec = pod.template["spec"], container.spec
        pod_sc, sc = pod_spec.get("securityContext") or {}, spec.get("securityContext") or {}
        args = ["create", "--pod", pod.pod_id, "--name", f"{self.namespace}-{pod.name}-{container.name}",
                "--label", f"{AGENT_LABEL}={self.namespace}"]  # fmt: skip
        user, group = sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))
        if user is not None:
            args += ["--user", f"{user}:{group if group is not None else user}"]
        if pod_sc.get("fsGroup") is not None:
            args += ["--group-add", str(pod_sc["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]  # as on a node: no tmpfs podman adds on its own
        capabilities = sc.get("capabilities") or {}
        args += [f"--cap-drop={c.lower()}" for c in capabilities.get("drop", [])]
        args += [f"--cap-add={c.lower()}" for c in capabilities.get("add", [])]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        limits = (spec.get("resources") or {}).get("limits") or {}
        if "cpu" in limits:
            args += ["--cpus", f"{cpu_quantity(limits['cpu']):g}"]
        if "memory" in limits:
            args += ["--memory", str(memory_bytes(limits["memory"]))]
        for name, value in self._env(pod, spec).items():
            args += ["--env", f"{name}={value}"]
        container.message_file = pod.dir / f"termination-{container.name}"
        container.message_file.write_text("")
        container.message_file.chmod(0o666)  # whoever the container runs as writes it, as on a node
        args += ["--volume", f"{container.message_file}:{spec.get('terminationMessagePath', '/dev/termination-log')}"]
        for mount in spec.get("volumeMounts", []):
            if mount["name"] in pod.image_volumes:  # read-only, as kubelet mounts an image volume
                args += ["--mount", f"type=image,source={pod.image_volumes[mount['name']]},"
                                    f"destination={mount['mountPath']}"]  # fmt: skip
                continue
            host, read_only = pod.volumes[mount["name"]]
            read_only = read_only or mount.get("readOnly", False)
            args += ["--volume", f"{host}:{mount['mountPath']}:{'ro' if read_only else 'rw'}"]
        if spec.get("command"):
            args += ["--entrypoint", json.dumps(spec["command"])]
        return [*args, spec["image"], *spec.get("args", [])]

    def _env(self, pod: Pod, spec: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in spec.get("envFrom", []):
            if "secretRef" in source:
                data = self._secret(source["secretRef"]["name"])
                if data is None:
                    raise LookupError(f'secret "{source["secretRef"]["name"]}" not found')
                env.update(data)
        for item in spec.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
                continue
            ref = item.get("valueFrom") or {}
            if "secretKeyRef" in ref:
                secret, key = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
                data = self._secret(secret)
                if data is None:
                    raise LookupError(f'secret "{secret}" not found')
                if key not in data:
                    raise LookupError(f"couldn't find key {key} in Secret {self.namespace}/{secret}")
                env[item["name"]] = data[key]
            elif "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                fields = {"metadata.name": pod.name, "metadata.namespace": self.namespace,
                          "status.podIP": pod.ip or "", "spec.nodeName": NODE_NAME}  # fmt: skip
                env[item["name"]] = fields.get(path, "")
        return env

    def _start(self, pod: Pod, container: Container) -> None:
        """Create (once) and start the container; a failure leaves it waiting with kubelet's reason."""
        image = container.spec["image"]
        if container.id is None:
            if not self._image_exists(image):
                container.waiting = ("ErrImagePull", f'image "{image}" is not in this node\'s image storage and the '
                                     "node agent never pulls (build it: make images)")  # fmt: skip
                container.retry_at = time.monotonic() + BACKOFF_S[1]
                return
            try:
                container.image_id = self.podman("image", "inspect", "--format", "{{.Id}}", image)
                container.id = self.podman(*self._container_args(pod, container))
            except LookupError as exc:
                container.waiting = ("CreateContainerConfigError", str(exc))
                container.retry_at = time.monotonic() + BACKOFF_S[1]
                return
            except PodmanError as exc:
                container.waiting = ("CreateContainerError", str(exc))
                container.retry_at = time.monotonic() + BACKOFF_S[1]
                return
        try:
            self.podman("start", container.id)
        except PodmanError as exc:
            container.waiting = ("RunContainerError", str(exc))
            container.retry_at = time.monotonic() + BACKOFF_S[min(container.restarts + 1, len(BACKOFF_S) - 1)]
            return
        container.running, container.waiting, container.started_at = True, None, now_iso()
        ports = {p["name"]: p["containerPort"] for p in container.spec.get("ports", []) if p.get("name")}
        started = time.monotonic()
        container.startup = Probe.parse(container.spec.get("startupProbe"), ports)
        container.readiness = Probe.parse(container.spec.get("readinessProbe"), ports)
        container.liveness = Probe.parse(container.spec.get("livenessProbe"), ports)
        for probe in (container.startup, container.readiness, container.liveness):
            if probe:
                probe.next_at = started + probe.initial_delay_s
        container.started = container.startup is None
        container.ready = container.started and container.readiness is None
        if pod.ip is None:
            infra = self.podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod.pod_id)
            pod.ip = self.podman("inspect", "--format", "{{.NetworkSettings.Networks.podman.IPAddress}}", infra)
            self.note(f"pod {pod.name}: IP {pod.ip}")

    def _image_exists(self, image: str) -> bool:
        return self.podman.succeeds("image", "exists", image)

    def _tend_containers(self, pod: Pod) -> None:
        """Start what should run, notice exits, run the probes, restart on failure (restartPolicy Always)."""
        if pod.problem or pod.pod_id is None or not self._volumes_ready(pod) or not self._initialized(pod):
            return
        now = time.monotonic()
        for container in pod.containers:
            if not container.running:
                if now >= container.retry_at:
                    self._start(pod, container)
                continue
            state = self.podman.state(container.id)
            if state["Status"] != "running":
                self._exited(pod, container, state)
                continue
            run = functools.partial(self._exec_probe, container.id)
            if not container.started:  # the other probes wait for the startup probe, as kubelet's do
                verdict = container.startup.check(pod.ip, now, run) if container.startup.due(now) else None
                if verdict is True:
                    container.started, container.ready = True, container.readiness is None
                    self.note(f"pod {pod.name}: container {container.name} passed its startup probe")
                elif verdict is False:
                    self._restart(pod, container, "startup")
                continue
            if container.readiness and container.readiness.due(now):
                verdict = container.readiness.check(pod.ip, now, run)
                if verdict is not None and verdict != container.ready:
                    container.ready = verdict
                    self.note(f"pod {pod.name}: container {container.name} {'ready' if verdict else 'not ready'}")
            liveness = container.liveness
            if liveness and liveness.due(now) and liveness.check(pod.ip, now, run) is False:
                self._restart(pod, container, "liveness")

    def _initialized(self, pod: Pod) -> bool:
        """Init containers in order, each to a successful exit (restarted with back-off when it fails), before any
        app container starts: kubelet's rule."""
        now = time.monotonic()
        for container in pod.init_containers:
            if container.completed:
                continue
            if not container.running:
                if now >= container.retry_at:
                    self._start(pod, container)
                return False
            state = self.podman.state(container.id)
            if state["Status"] == "running":
                return False
            if state.get("ExitCode") == 0:
                container.running, container.completed = False, True
                container.last_exit = {"exitCode": 0, "reason": "Completed", "startedAt": container.started_at,
                                       "finishedAt": now_iso(), **self._termination_message(container, 0)}  # fmt: skip
                self.note(f"pod {pod.name}: init container {container.name} completed")
                continue
            self._exited(pod, container, state)
            return False
        return True

    def _termination_message(self, container: Container, exit_code: int) -> dict[str, str]:
        """What the container wrote to its terminationMessagePath, else (FallbackToLogsOnError, after a failure)
        its log's tail, as kubelet reports it."""
        text = container.message_file.read_text()[:4096] if container.message_file else ""
        if not text and exit_code and container.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            text = "\n".join(self.podman.logs(container.id).splitlines()[-80:])[-2048:]
        return {"message": text} if text else {}

    def _exec_probe(self, container_id: str, command: list[str], timeout_s: float) -> bool:
        """An exec probe: the command in the container, passed when it exits 0 within its timeout (plus podman's own
        start)."""
        return self.podman.succeeds("exec", container_id, *command, timeout=timeout_s + 5)

    def _restart(self, pod: Pod, container: Container, probe: str) -> None:
        self.note(f"pod {pod.name}: container {container.name} failed its {probe} probe; restarting it")
        grace = pod.template["spec"].get("terminationGracePeriodSeconds", 30)
        self.podman("stop", "--time", str(grace), container.id, check=False)
        self._exited(pod, container, self.podman.state(container.id))

    def _exited(self, pod: Pod, container: Container, state: dict[str, Any]) -> None:
        container.running = container.ready = False
        container.last_exit = {"exitCode": state.get("ExitCode", -1), "reason": "OOMKilled" if state.get("OOMKilled")
                               else "Error" if state.get("ExitCode") else "Completed",
                               "startedAt": container.started_at, "finishedAt": now_iso(),
                               **self._termination_message(container, state.get("ExitCode", -1))}  # fmt: skip
        container.restarts += 1
        delay = BACKOFF_S[min(container.restarts - 1, len(BACKOFF_S) - 1)]
        container.retry_at = time.monotonic() + delay
        container.waiting = ("CrashLoopBackOff", f"back-off {delay}s restarting failed container={container.name} "
                             f"pod={pod.name}")  # fmt: skip
        self.note(f"pod {pod.name}: container {container.name} exited with {container.last_exit['exitCode']}")

    def _terminate(self, pod: Pod) -> None:
        """Not ready at once (out of the Service), then preStop, SIGTERM and SIGKILL at the grace period's end."""
        pod.terminating = True
        self.note(f"pod {pod.name}: terminating")
        self._write_pod(pod)
        thread = threading.Thread(target=self._shut_down, args=(pod,), name=f"stop-{pod.name}", daemon=True)
        self._terminators.append(thread)
        thread.start()

    def _shut_down(self, pod: Pod) -> None:
        started = time.monotonic()
        grace = pod.template["spec"].get("terminationGracePeriodSeconds", 30)
        deadline = started + grace
        running = [c for c in [*pod.init_containers, *pod.containers] if c.id and c.running]

        def stop(container: Container) -> int:
            hook = (container.spec.get("lifecycle") or {}).get("preStop") or {}
            if "sleep" in hook:
                time.sleep(max(0.0, min(hook["sleep"]["seconds"], deadline - time.monotonic())))
            elif "exec" in hook:
                self.podman("exec", container.id, *hook["exec"]["command"], check=False, timeout=grace)
            elif "httpGet" in hook and pod.ip:
                port = pod.port(hook["httpGet"]["port"])
                try:
                    url = f"http://{pod.ip}:{port}{hook['httpGet'].get('path', '/')}"
                    urllib.request.urlopen(url, timeout=max(1.0, deadline - time.monotonic())).close()
                except OSError:
                    pass
            remaining = max(1, int(deadline - time.monotonic()))
            self.podman("stop", "--time", str(remaining), container.id, check=False, timeout=remaining + 30)
            return self.podman.state(container.id).get("ExitCode", -1)

        with ThreadPoolExecutor(max(1, len(running))) as pool:
            codes = dict(zip([c.name for c in running], pool.map(stop, running), strict=True))
        if pod.pod_id:
            self.podman("pod", "rm", "--force", "--time", "0", pod.pod_id, check=False)
        with contextlib.suppress(Exception):  # already gone
            self.core.delete_namespaced_pod(pod.name, self.namespace)
        shutil.rmtree(pod.dir, ignore_errors=True)
        shutil.rmtree(Path("/dev/shm") / f"overlap-agent-{os.getpid()}" / pod.name, ignore_errors=True)
        took = time.monotonic() - started
        self.terminations.append({"pod": pod.name, "seconds": round(took, 1), "exit_codes": codes})
        self.note(f"pod {pod.name}: removed after {took:.1f} s, exit codes {codes}")
        pod.gone = True

    def _write_pod(self, pod: Pod) -> None:
        if pod.unschedulable:
            scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                         "message": pod.unschedulable}  # fmt: skip
            self._patch_pod_status(pod, {"phase": "Pending", "conditions": [scheduled]})
            return
        initialized = all(c.completed for c in pod.init_containers)

        def status_of(c: Container, init: bool) -> dict[str, Any]:
            if c.running:
                state = {"running": {"startedAt": c.started_at}}
            elif init and c.completed:
                state = {"terminated": c.last_exit}
            elif c.waiting and (init or initialized or c.waiting[0] != "ContainerCreating"):
                state = {"waiting": {"reason": c.waiting[0], "message": c.waiting[1]}}
            else:
                state = {"waiting": {"reason": "ContainerCreating" if initialized else "PodInitializing"}}
            ready = c.completed if init else c.ready
            entry = {"name": c.name, "image": c.spec["image"], "imageID": c.image_id, "ready": ready,
                     "started": c.running, "restartCount": c.restarts, "state": state}  # fmt: skip
            if c.id:
                entry["containerID"] = f"podman://{c.id}"
            if c.last_exit and not (init and c.completed):
                entry["lastState"] = {"terminated": c.last_exit}
            return entry

        statuses = [status_of(c, False) for c in pod.containers]
        init_statuses = [status_of(c, True) for c in pod.init_containers]
        ready = pod.ready
        all_running = bool(pod.containers) and all(c.running for c in pod.containers)
        unready = [c.name for c in pod.containers if not c.ready]
        why = {} if ready else {"reason": "ContainersNotReady",
                                "message": f"containers with unready status: [{' '.join(unready)}]"}  # fmt: skip
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": str(initialized)},
            {"type": "ContainersReady", "status": str(ready), **why},
            {"type": "Ready", "status": str(ready), **why},
        ]
        status = {"phase": "Running" if all_running or pod.terminating else "Pending", "hostIP": "127.0.0.1",
                  "conditions": conditions, "containerStatuses": statuses}  # fmt: skip
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        if pod.ip:
            status |= {"podIP": pod.ip, "podIPs": [{"ip": pod.ip}]}
        if pod.problem:
            status |= {"reason": pod.problem[0], "message": pod.problem[1]}
        self._patch_pod_status(pod, status)

    def _patch_pod_status(self, pod: Pod, status: dict[str, Any]) -> None:
        """Write the Pod's status when it changed."""
        text = json.dumps(status, sort_keys=True)
        if text != pod.written:
            try:
                self.core.patch_namespaced_pod_status(
                    pod.name, self.namespace, {"status": status}, _preload_content=False
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return  # the Pod object is gone: this pod is terminating, with nothing left to report to
            pod.written = text

    # ---- kube-proxy and Prometheus discovery ---------------------------------------------------------------------
    def _sync_services(self) -> list[dict[str, Any]]:
        services = self._list(self.core.list_namespaced_service)
        live = {s["metadata"]["name"] for s in services}
        for proxies in (self.proxies, self.pod_proxies):
            for name in [n for n in proxies if n not in live]:  # the Service went: so does its proxy
                proxies.pop(name).close()
                self.note(f"service {name}: gone, proxy closed")
        for service in services:
            name, spec = service["metadata"]["name"], service["spec"]
            if not spec.get("ports") or spec.get("clusterIP") == "None":
                continue  # a headless Service has no virtual address to proxy: its name resolves to its pods
            if self.selectors.get(name) not in (None, spec.get("selector")):
                self.note(f"service {name}: selector now {spec.get('selector')}")
            self.selectors[name] = spec.get("selector") or {}
            port = spec["ports"][0]

            def endpoints(n=name, p=port):
                return self._endpoints(self.selectors[n], p)

            if name not in self.proxies:
                self.proxies[name] = ServiceProxy(name, endpoints, self.proxy_ports.get(name, 0))
                self.note(f"service {name}: proxy on 127.0.0.1:{self.proxies[name].port}")
            if name not in self.pod_proxies:
                try:  # the bridge (and its gateway address) exists once a first pod runs
                    self.pod_proxies[name] = ServiceProxy(name, endpoints, port["port"], host=self.gateway)
                    self.note(f"service {name}: proxy for pods on {self.gateway}:{port['port']}")
                except OSError:
                    pass
        return services

    def _write_headless_dns(self, services: list[dict[str, Any]]) -> None:
        """Each headless Service's name resolves to its ready pods' IPs: lines in every pod's /etc/hosts (podman's
        file, shared by the pod's containers), rewritten in place when they change (glibc answers every line)."""
        lines = set()
        for service in services:
            spec = service["spec"]
            if spec.get("clusterIP") != "None" or not spec.get("ports"):
                continue
            svc = f"{service['metadata']['name']}.{self.namespace}.svc"
            for ip, _ in self._endpoints(spec.get("selector") or {}, spec["ports"][0]):
                lines.add(f"{ip}\t{svc} {svc}.cluster.local\n")
        block = "".join(sorted(lines))
        for pod in list(self.pods.values()):
            if pod.pod_id is None or pod.gone or pod.terminating or pod.dns_written == block:
                continue
            if pod.hosts_file is None:
                infra = self.podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod.pod_id, check=False)
                path = self.podman("inspect", "--format", "{{.HostsPath}}", infra, check=False) if infra else ""
                if not path or not os.path.exists(path):
                    continue  # written when the pod starts: the next pass
                pod.hosts_file = path
            with open(pod.hosts_file, "r+") as hosts:
                kept = hosts.read().split(HEADLESS_MARK)[0]
                hosts.seek(0)
                hosts.truncate()
                hosts.write(kept + HEADLESS_MARK + block)
            pod.dns_written = block

    def _endpoints(self, selector: dict[str, str], port: dict[str, Any]) -> list[tuple[str, int]]:
        target = port.get("targetPort", port["port"])
        found = []
        for pod in list(self.pods.values()):
            if pod.ready and pod.ip and all(pod.labels.get(k) == v for k, v in selector.items()):
                number = pod.port(target)
                if number:
                    found.append((pod.ip, number))
        return sorted(found)

    def _write_service_discovery(self) -> None:
        if self.sd_file is None:
            return
        groups = []
        for pod in sorted(self.pods.values(), key=lambda p: p.name):
            annotations = pod.template.get("metadata", {}).get("annotations", {})
            if not pod.ip or pod.gone or annotations.get("prometheus.io/scrape") != "true":
                continue
            service = pod.labels.get(INSTANCE_LABEL, pod.deployment)
            labels = {"namespace": self.namespace, "pod": pod.name, "service": service,
                      "__metrics_path__": annotations.get("prometheus.io/path", "/metrics")}  # fmt: skip
            groups.append({"targets": [f"{pod.ip}:{annotations.get('prometheus.io/port', '80')}"], "labels": labels})
        text = json.dumps(groups, indent=1)
        if not self.sd_file.exists() or self.sd_file.read_text() != text:
            tmp = self.sd_file.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.sd_file)


def rolling_limits(strategy: dict[str, Any], desired: int) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as pod counts, as the Deployment controller reads them: a percentage of the
    replicas, surge rounded up and unavailable down; the Kubernetes defaults are 25% each."""
    rolling = strategy.get("rollingUpdate") or {}

    def count(value: int | str, round_up: bool) -> int:
        if isinstance(value, str) and value.endswith("%"):
            share = int(value[:-1]) * desired
            return -(-share // 100) if round_up else share // 100
        return int(value)

    return count(rolling.get("maxSurge", "25%"), True), count(rolling.get("maxUnavailable", "25%"), False)


def write_atomic_volume(folder: Path, files: dict[str, str], version: str) -> None:
    """kubelet's atomic writer: the files in a new `..VERSION` folder, `..data` swapped to it in one rename, and
    each name a symlink through `..data`, so a reader sees the old set or the new one, never a mix."""
    data_dir = folder / f"..{version}"
    data_dir.mkdir(exist_ok=True)
    for name, content in files.items():
        target = data_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        target.chmod(0o644)
    link = folder / "..data_tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(data_dir.name)
    os.replace(link, folder / "..data")
    for name in files:
        top = name.split("/")[0]
        if not (folder / top).is_symlink():
            (folder / top).symlink_to(f"..data/{top}")
    for old in folder.glob("..?*"):
        if old.is_dir() and not old.is_symlink() and old.name != data_dir.name:
            shutil.rmtree(old, ignore_errors=True)


class ServiceProxy:
    """A Service's virtual IP, as kube-proxy gives one: a TCP listener on 127.0.0.1 that sends each new connection
    to the next ready endpoint (round robin). Open connections keep their endpoint while it drains; with no ready
    endpoint a connection is refused at once (closed), as kube-proxy rejects it."""

    def __init__(self, name: str, endpoints, port: int = 0, host: str = "127.0.0.1") -> None:
        self.name, self.endpoints = name, endpoints
        self.listener = socket.create_server((host, port))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self._next = 0
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy-{name}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            endpoints = self.endpoints()
            if not endpoints:
                client.close()
                continue
            target = endpoints[self._next % len(endpoints)]
            self._next += 1
            self.connections += 1
            threading.Thread(target=self._connect, args=(client, target), daemon=True).start()

    @staticmethod
    def _connect(client: socket.socket, target: tuple[str, int]) -> None:
        try:
            upstream = socket.create_connection(target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                    with contextlib.suppress(OSError):
                        sock.shutdown(how)

        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join()
        client.close()
        upstream.close()
