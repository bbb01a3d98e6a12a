"""The objects an InferenceService owns, built as plain dicts by pure functions (no Kubernetes calls).

Every builder takes the service's name, namespace and defaulted spec (see `spec.with_defaults`) and returns one
manifest. `build_children` returns them all, each with an owner reference to the InferenceService, so that
deleting the service deletes them (Kubernetes' garbage collector) and the operator sees edits to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap.engine.config import EngineConfig
from overlap.operator import spec as specs
from overlap.operator.identity import (
    ADMIN_TOKENS_SECRET,
    INSTANCE_LABEL,
    OWNED,
    RESTART_HASH_ANNOTATION,
    activator_labels,
    activator_name,
    configmap_name,
    labels,
    owner_reference,
    pods_service_name,
    replicas_service_name,
    router_labels,
    router_name,
    selector_labels,
)
from overlap.operator.model_volumes import model_parts

# The pod contract shared with the sidecar and engine commands (docs/design.md, "The pod").
SOCKET_DIR = "/run/overlap"
SOCKET = f"{SOCKET_DIR}/engine.sock"
SIDECAR_ALIVE = f"{SOCKET_DIR}/sidecar.alive"  # exists while the sidecar runs (its --alive-file)
CONFIG_DIR = "/etc/overlap"
CONFIG_FILE = f"{CONFIG_DIR}/engine.json"
ADMIN_TOKEN_DIR = "/var/run/secrets/overlap"
ADMIN_TOKEN_FILE = f"{ADMIN_TOKEN_DIR}/admin-token"
API_KEY_ENV = "OVERLAP_API_KEY"
RUN_AS_USER = 10001
# Seconds for the Service's endpoints to drop a terminating pod before the sidecar stops taking requests.
ENDPOINT_DRAIN_S = 5
GRACE_MARGIN_S = 10
STARTUP_PROBE_PERIOD_S = 2  # the engine is ready within this of its model load (a failed probe is cheap)
# The engine's model load may take this long when spec.pod.startupSeconds is unset; past it kubelet restarts the
# engine container, so a load that hangs never holds its GPU for good.
DEFAULT_STARTUP_S = 3600
# The engine's own probe: asks it over its socket for stats (overlap.engine.serving.probe; only the wire protocol is
# imported, about 0.2 s of CPU a run). The engine answers between steps, and one step of a large model on a CPU can
# take many seconds: a liveness verdict takes three misses of ENGINE_PROBE_TIMEOUT_S each, over a minute.
ENGINE_PROBE_TIMEOUT_S = 20
ENGINE_PROBE = ["python", "-m", "overlap.engine.serving.probe", "--socket", SOCKET, "--timeout",
                str(ENGINE_PROBE_TIMEOUT_S)]  # fmt: skip
# How long a rollout may go without progress before the Deployment (and so the service) reports it stuck: a cold GPU
# pod pulls an image of several GB, maybe fetches its model, and loads it, which Kubernetes' default of 600 s does not
# cover. The time kubelet allows the engine to start (startupSeconds, its default included) plus this for the pull.
PULL_MARGIN_S = 600
# Prometheus' name for the scraped Service's INSTANCE_LABEL (a label name's "." and "/" become "_").
SERVICE_LABEL_META = "__meta_kubernetes_service_label_" + INSTANCE_LABEL.replace(".", "_").replace("/", "_")


def routed(spec: Mapping[str, Any]) -> bool:
    """routing.mode prefix: the Service points at `overlap router`, which picks a pod per request."""
    return spec["routing"]["mode"] == "prefix"


def has_activator(spec: Mapping[str, Any]) -> bool:
    """minReplicas 0 with a loop that scales, and no router: the service gets an activator to hold requests while
    at zero (a routed service's router holds them itself)."""
    auto = spec["autoscaling"]
    return auto["minReplicas"] == 0 and auto["mode"] in specs.SCALING_MODES and not routed(spec)


def at_zero(spec: Mapping[str, Any], ready: int) -> bool:
    """Whether the Service should route to the activator: no replica asked for, or none of them (`ready`) ready.
    Asked for 0, the switch comes before the pods go, so requests during their drain reach the activator, which
    forwards them to the pods while they still serve."""
    return has_activator(spec) and (spec["replicas"] == 0 or ready == 0)


def service_url(name: str, namespace: str, spec: Mapping[str, Any]) -> str:
    return f"http://{name}.{namespace}.svc:{spec['sidecar']['port']}"


def _metadata(name: str, namespace: str, owner: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": labels(owner), **extra}


def build_configmap(name: str, namespace: str, config: EngineConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(configmap_name(name), namespace, name),
        "data": {"engine.json": specs.engine_json(config)},
    }


def _http_service(metadata: dict[str, Any], selector: dict[str, str], port: int) -> dict[str, Any]:
    """A ClusterIP Service with the one public port (the admin port is never on a Service)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_service(name: str, namespace: str, spec: Mapping[str, Any], to_activator: bool = False) -> dict[str, Any]:
    """The public API only: to the router of a routed service, else to the pods (the activator at zero)."""
    if routed(spec):
        selector = router_labels(name)
    else:
        selector = activator_labels(name) if to_activator else selector_labels(name)
    return _http_service(_metadata(name, namespace, name), selector, spec["sidecar"]["port"])


def build_replicas_service(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine pods as the router finds them: headless, so its DNS name answers with each ready pod's address.
    It carries the service's labels, so the ServiceMonitor scrapes the pods through it (and the router through
    the public Service)."""
    service = _http_service(_metadata(replicas_service_name(name), namespace, name), selector_labels(name),
                            spec["sidecar"]["port"])  # fmt: skip
    service["spec"]["clusterIP"] = "None"
    service["spec"]["publishNotReadyAddresses"] = False
    return service


def build_pods_service(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The engine pods whatever the public Service routes to: where the activator forwards. Its labels leave out
    the selector labels, so a ServiceMonitor (which selects Services by them) does not scrape the pods twice."""
    metadata = _metadata(pods_service_name(name), namespace, name)
    metadata["labels"] = {INSTANCE_LABEL: name, **OWNED}
    return _http_service(metadata, selector_labels(name), spec["sidecar"]["port"])


def build_activator(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`overlap activator` (the sidecar image, no GPU) on the public port, forwarding to the pods' Service."""
    port = spec["sidecar"]["port"]
    args = ["activator", "--upstream", f"http://{pods_service_name(name)}.{namespace}.svc:{port}", "--port", str(port),
            "--hold-timeout-s", str(spec["sidecar"]["requestTimeoutSeconds"])]  # fmt: skip
    # At zero replicas the public Service routes here, so its ServiceMonitor scrapes /metrics here too.
    return _proxy_deployment(activator_name(name), namespace, name, spec, "activator", activator_labels(name), args,
                             health="/activator/healthz", metrics="/activator/metrics")  # fmt: skip


def build_router(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`overlap router` (the sidecar image, no GPU) on the public port, picking among the ready engine pods (the
    addresses of the headless replicas Service) by their cached prefixes and load; it holds requests while none is
    ready, which makes it the activator of a service that scales to zero."""
    port, routing = spec["sidecar"]["port"], spec["routing"]
    args = ["router", "--replicas-from", f"{replicas_service_name(name)}.{namespace}.svc:{port}", "--port", str(port),
            "--hold-timeout-s", str(spec["sidecar"]["requestTimeoutSeconds"]),
            "--session-header", routing["sessionHeader"]]  # fmt: skip
    router = _proxy_deployment(router_name(name), namespace, name, spec, "router", router_labels(name), args,
                               health="/router/healthz", metrics="/metrics", memory="1Gi")  # fmt: skip
    router["spec"]["replicas"] = routing["routerReplicas"]
    return router


def _proxy_deployment(deployment: str, namespace: str, owner: str, spec: Mapping[str, Any], component: str,
                      pod_labels: dict[str, str], args: list[str], *, health: str, metrics: str,
                      memory: str = "256Mi") -> dict[str, Any]:  # fmt: skip
    """One pod of the sidecar image running `overlap ARGS` on the public port: the activator or the router. Its
    health endpoint answers while it runs: it must take requests to hold them, ready replicas or not."""
    port = spec["sidecar"]["port"]
    metadata = _metadata(deployment, namespace, owner)
    metadata["labels"] = {**metadata["labels"], **pod_labels, "app.kubernetes.io/component": component}
    probe = {"httpGet": {"path": health, "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 5}
    container = {
        "name": component,
        "image": spec["images"]["sidecar"],
        "imagePullPolicy": spec["images"]["pullPolicy"],
        "command": ["overlap"],
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": memory}},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {
                    "labels": metadata["labels"],
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(port),
                        "prometheus.io/path": metrics,
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def build_pdb(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(name, namespace, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def build_servicemonitor(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    metadata = _metadata(name, namespace, name)
    metadata["labels"] = {**(spec["prometheus"]["serviceMonitor"].get("labels") or {}), **metadata["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            # A routed service has two such Services (the router's and the pods'): both scrapes are labelled with the
            # InferenceService's name, which the control loop's queries select by, not with their Service's.
            "endpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": spec["prometheus"]["serviceMonitor"]["interval"],
                    "relabelings": [
                        {"sourceLabels": [SERVICE_LABEL_META], "targetLabel": "service", "action": "replace"}
                    ],
                }
            ],
        },
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _sidecar_args(spec: Mapping[str, Any]) -> list[str]:
    sidecar = spec["sidecar"]
    args = [
        "sidecar",
        "--engine-socket", SOCKET,
        "--port", str(sidecar["port"]),
        "--admin-port", str(sidecar["adminPort"]),
        "--admin-token-file", ADMIN_TOKEN_FILE,
        "--watch-config", CONFIG_FILE,
        "--served-model-name", spec["model"]["servedName"],
        "--max-queued-requests", str(sidecar["maxQueuedRequests"]),
        "--max-queued-tokens", str(sidecar["maxQueuedTokens"]),
        "--max-inflight", str(sidecar["maxInflight"]),
        "--request-timeout-s", str(sidecar["requestTimeoutSeconds"]),
        "--grace-period-s", str(sidecar["gracePeriodSeconds"]),
        "--alive-file", SIDECAR_ALIVE,
    ]  # fmt: skip
    if sidecar.get("apiKeySecret"):
        args += ["--api-key-env", API_KEY_ENV]
    return args


def _wait_while_exists(path: str, timeout_s: int) -> list[str]:
    """A preStop command (POSIX sh, in the engine image) that returns once `path` is gone, or after `timeout_s`."""
    polls = 10 * int(timeout_s)
    return ["sh", "-c", f"i=0; while [ -e {path} ] && [ $i -lt {polls} ]; do sleep 0.1; i=$((i + 1)); done"]


def build_deployment(name: str, namespace: str, spec: Mapping[str, Any], config: EngineConfig) -> dict[str, Any]:
    resources, sidecar = spec["resources"], spec["sidecar"]
    grace = sidecar["gracePeriodSeconds"]
    # Quantities as strings: that is how the API server returns them, so drift checks compare like with like.
    ranks = config.tensor_parallel_size  # resources.engine.cpu is each rank's; /dev/shm holds their collectives
    engine_limits = {"cpu": specs.per_rank_cpu(resources["engine"]["cpu"], ranks),
                     "memory": str(resources["engine"]["memory"])}  # fmt: skip
    if resources["gpus"] > 0:
        engine_limits[resources["gpuResourceName"]] = str(resources["gpus"])
    sidecar_limits = {"cpu": str(resources["sidecar"]["cpu"]), "memory": str(resources["sidecar"]["memory"])}
    model = model_parts(spec, _container_security())
    images = spec["images"]

    engine_container = {
        "name": "engine",
        "image": images["engine"],
        "imagePullPolicy": images["pullPolicy"],
        "command": ["overlap"],
        "args": ["engine", "--socket", SOCKET, "--config", CONFIG_FILE],
        "env": [
            {"name": "HOME", "value": "/tmp"},
            {"name": "OVERLAP_CACHE_DIR", "value": "/tmp/overlap-cache"},
            # OpenMP (torch, oneDNN) sizes its pool from the node's cores unless told: the container's CPU limit
            {"name": "OMP_NUM_THREADS", "value": str(config.num_threads or 1)},
        ],
        "resources": {"requests": dict(engine_limits), "limits": dict(engine_limits)},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "socket", "mountPath": SOCKET_DIR},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *model.engine_mounts,
        ],
        # The engine outlives the sidecar's drain (in-flight requests still need it), and no longer: its preStop
        # waits for the sidecar's alive file to go, at most the endpoint drain plus the sidecar's grace period.
        "lifecycle": {"preStop": {"exec": {"command": _wait_while_exists(SIDECAR_ALIVE, ENDPOINT_DRAIN_S + grace)}}},
    }
    sidecar_env = [{"name": "HOME", "value": "/tmp"}]
    if sidecar.get("apiKeySecret"):
        secret = sidecar["apiKeySecret"]
        sidecar_env.append(
            {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}}
        )
    sidecar_container = {
        "name": "sidecar",
        "image": images["sidecar"],
        "imagePullPolicy": images["pullPolicy"],
        "command": ["overlap"],
        "args": _sidecar_args(spec),
        "env": sidecar_env,
        "ports": [
            {"name": "http", "containerPort": sidecar["port"], "protocol": "TCP"},
            {"name": "admin", "containerPort": sidecar["adminPort"], "protocol": "TCP"},
        ],
        # /readyz is 503 while the engine is away (crashed, restarting): the Service stops sending this pod new
        # requests within two periods. Two misses, so one slow answer under load does not pull a busy pod out.
        # Timeouts that hold under load: the sidecar answers probes on the event loop that streams every response,
        # and with kubelet's default of 1 s a busy sidecar misses them (readiness drops the pod, liveness restarts it
        # and cuts its streams).
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 2,
            "timeoutSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": {"requests": dict(sidecar_limits), "limits": dict(sidecar_limits)},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "socket", "mountPath": SOCKET_DIR},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        # Let the endpoints controller take the pod out of the Service before SIGTERM starts the drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": ENDPOINT_DRAIN_S}}},
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": ENDPOINT_DRAIN_S + grace + GRACE_MARGIN_S,
        "securityContext": {**_pod_security(), "fsGroup": RUN_AS_USER},  # the volumes the engine writes
        "containers": [engine_container, sidecar_container],
        "volumes": [
            {"name": "socket", "emptyDir": {}},
            # A whole-folder ConfigMap mount (never subPath), so live-knob edits reach the running sidecar.
            {"name": "config", "configMap": {"name": configmap_name(name)}},
            {
                "name": "admin-token",
                "secret": {"secretName": ADMIN_TOKENS_SECRET, "items": [{"key": name, "path": "admin-token"}]},
            },
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{ranks}Gi"}},
            *model.volumes,
        ],
    }
    if model.init_containers:
        pod_spec["initContainers"] = model.init_containers
    for key in ("nodeSelector", "tolerations", "affinity"):
        if resources.get(key):
            pod_spec[key] = resources[key]
    pull_secrets = list(dict.fromkeys([*(images.get("pullSecrets") or []), *model.pull_secrets]))
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in pull_secrets]
    pod = spec.get("pod") or {}
    for key in ("runtimeClassName", "priorityClassName", "serviceAccountName", "topologySpreadConstraints"):
        if pod.get(key):
            pod_spec[key] = pod[key]
    pod_spec["volumes"] += pod.get("volumes") or []
    engine_container["volumeMounts"] += pod.get("volumeMounts") or []
    if pod.get("env"):
        for container in (engine_container, sidecar_container, *model.init_containers):
            container["env"] = _merged_env(container["env"], pod["env"])
    # The engine holds the GPU, so its probes are its own: kubelet restarts the engine container when its model load
    # outlasts startupSeconds or its loop stops answering (liveness waits until the startup probe has passed).
    startup_s = pod.get("startupSeconds") or DEFAULT_STARTUP_S
    engine_container["startupProbe"] = {
        "exec": {"command": ENGINE_PROBE},
        "periodSeconds": STARTUP_PROBE_PERIOD_S,
        "timeoutSeconds": ENGINE_PROBE_TIMEOUT_S + 5,
        "failureThreshold": -(-startup_s // STARTUP_PROBE_PERIOD_S),
    }
    engine_container["livenessProbe"] = {
        "exec": {"command": ENGINE_PROBE},
        "periodSeconds": 10,
        "timeoutSeconds": ENGINE_PROBE_TIMEOUT_S + 5,
        "failureThreshold": 3,
    }

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace, name),
        "spec": {
            "replicas": spec["replicas"],
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": startup_s + PULL_MARGIN_S,
            "selector": {"matchLabels": selector_labels(name)},
            # By default a new pod comes up before an old one goes, one at a time (spec.rollout).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": spec["rollout"]["maxSurge"],
                    "maxUnavailable": spec["rollout"]["maxUnavailable"],
                },
            },
            "template": {
                "metadata": {
                    "labels": {**(pod.get("labels") or {}), **labels(name)},
                    "annotations": {
                        **(pod.get("annotations") or {}),
                        RESTART_HASH_ANNOTATION: specs.restart_hash(config),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(sidecar["port"]),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def _merged_env(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per name, the user's winning, in a stable order (ours first). An empty value is left out, as the API
    server leaves it out of what it returns (so the drift check sees no change)."""
    by_name = {item["name"]: item for item in ours}
    for item in theirs:
        entry = {"name": item["name"]}
        if item.get("valueFrom"):
            entry["valueFrom"] = item["valueFrom"]
        elif item.get("value"):
            entry["value"] = item["value"]
        by_name[item["name"]] = entry
    return list(by_name.values())


def build_children(
    owner: Mapping[str, Any], spec: Mapping[str, Any], config: EngineConfig, *, with_servicemonitor: bool
) -> list[dict[str, Any]]:
    """Every child the operator keeps in line with the spec (the admin tokens are admin_tokens.py's)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    children = [build_configmap(name, namespace, config)]
    # the Service a proxy forwards to before the proxy: its pod may resolve the name when it starts
    if has_activator(spec):
        children += [build_pods_service(name, namespace, spec), build_activator(name, namespace, spec)]
    if routed(spec):
        children += [build_replicas_service(name, namespace, spec), build_router(name, namespace, spec)]
    # The Service before the Deployment: scaled to zero, requests go to the activator before the pods go.
    ready = (owner.get("status") or {}).get("readyReplicas") or 0
    children += [
        build_service(name, namespace, spec, to_activator=at_zero(spec, ready)),
        build_deployment(name, namespace, spec, config),
        build_pdb(name, namespace),
    ]
    if with_servicemonitor and spec["prometheus"]["serviceMonitor"]["enabled"]:
        children.append(build_servicemonitor(name, namespace, spec))
    return [adopt(child, owner) for child in children]


def adopt(child: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    child["metadata"]["ownerReferences"] = [owner_reference(owner)]
    return child
