"""The objects the operator builds, checked without Kubernetes: the pod contract, strict schema validity, hashing."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import kubernetes_validate
import pytest

from overlap.engine.config import LiveKnobs
from overlap.operator import children, identity, status
from overlap.operator import spec as specs
from overlap.operator.children.containers import wait_while_exists
from overlap.operator.drift import is_subset

K8S_VERSION = kubernetes_validate.latest_version()
OWNER = {
    "apiVersion": "overlap.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llm", "namespace": "ml", "uid": "0f6c1c1e-0000-4000-8000-000000000001", "generation": 3},
}


def build(spec_overrides: dict | None = None, *, monitor: bool = True) -> dict[str, dict]:
    spec = specs.with_defaults({"model": {"servedName": "llm", "path": "/models/llm"}, **(spec_overrides or {})})
    config = specs.check_spec(spec)
    built = children.build_children(OWNER, spec, config, with_servicemonitor=monitor)
    return {obj["kind"]: obj for obj in built}


def containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"model": {"servedName": "llm", "path": "/models/llm", "source": "pvc", "claimName": "weights"}},
        {
            "model": {
                "servedName": "llm",
                "path": "/m/llm",
                "source": "hostPath",
                "hostPath": "/data/m",
                "mountPath": "/m",
            }
        },
        {
            "resources": {
                "gpus": 0,
                "nodeSelector": {"pool": "cpu"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
            },
            "sidecar": {"apiKeySecret": {"name": "llm-key"}},
            "images": {"pullSecrets": ["registry"]},
        },
    ],
    ids=["image", "pvc", "hostPath", "cpu-apikey"],
)
def test_every_built_object_passes_strict_schema_validation(overrides: dict) -> None:
    for kind, obj in build(overrides).items():
        if kind == "ServiceMonitor":
            continue  # not a built-in kind: kubernetes-validate has no schema for it
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_pod_follows_the_deployment_contract() -> None:
    deployment = build({"resources": {"gpus": 1, "engine": {"cpu": "3500m"}},
                        "sidecar": {"apiKeySecret": {"name": "llm-key"}}})["Deployment"]  # fmt: skip
    pod = deployment["spec"]["template"]["spec"]
    engine, sidecar = containers(deployment)["engine"], containers(deployment)["sidecar"]
    assert engine["args"] == ["engine", "--socket", "/run/overlap/engine.sock", "--config", "/etc/overlap/engine.json"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # threads follow the CPU limit (3.5 CPUs: 3 whole ones), in the engine config and for OpenMP
    assert {"name": "OMP_NUM_THREADS", "value": "3"} in engine["env"]
    args = sidecar["args"]
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == "sidecar"
    assert pairs["--engine-socket"] == "/run/overlap/engine.sock"
    assert (pairs["--port"], pairs["--admin-port"]) == ("8000", "8001")
    assert pairs["--admin-token-file"] == "/var/run/secrets/overlap/admin-token"
    assert pairs["--watch-config"] == "/etc/overlap/engine.json"
    assert pairs["--served-model-name"] == "llm"
    assert pairs["--api-key-env"] == "OVERLAP_API_KEY"
    for flag in ("--max-queued-requests", "--max-queued-tokens", "--max-inflight", "--request-timeout-s"):
        assert flag in pairs
    key_env = next(e for e in sidecar["env"] if e["name"] == "OVERLAP_API_KEY")
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "llm-key", "key": "api-key"}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert {p["containerPort"] for p in sidecar["ports"]} == {8000, 8001}
    # Shared socket folder; the ConfigMap mounted as a folder (subPath mounts never see updates).
    for container in (engine, sidecar):
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/run/overlap"]["name"] == "socket"
        assert mounts["/etc/overlap"]["name"] == "config" and "subPath" not in mounts["/etc/overlap"]
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
        assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The drain: endpoints drop the pod, the sidecar drains, the engine outlives it, all within the grace period.
    grace = pod["terminationGracePeriodSeconds"]
    alive = sidecar["args"][sidecar["args"].index("--alive-file") + 1]
    assert alive.startswith("/run/overlap/")  # on the volume both containers mount
    wait = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[:2] == ["sh", "-c"] and alive in wait[2]
    drain = sidecar["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert f"-lt {10 * (drain + specs.DEFAULTS['sidecar']['gracePeriodSeconds'])} ]" in wait[2]  # bounded, 0.1 s polls
    assert drain + specs.DEFAULTS["sidecar"]["gracePeriodSeconds"] < grace


def test_the_engines_pre_stop_returns_once_the_sidecars_alive_file_is_gone(tmp_path) -> None:
    """The command itself, run by a real sh: it waits while the file exists, and returns once it is removed."""
    alive = tmp_path / "sidecar.alive"
    alive.write_text("1")
    command = wait_while_exists(str(alive), 30)
    threading.Timer(0.5, alive.unlink).start()
    started = time.monotonic()
    subprocess.run(command, check=True, timeout=10)
    assert 0.4 < time.monotonic() - started < 3
    alive.write_text("1")  # never removed: the bound ends it
    started = time.monotonic()
    subprocess.run(wait_while_exists(str(alive), 1), check=True, timeout=10)
    assert 0.9 < time.monotonic() - started < 5


def test_service_exposes_the_public_port_only() -> None:
    service = build()["Service"]
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]
    assert service["spec"]["selector"] == identity.selector_labels("llm")


def test_every_child_is_owned_by_the_inferenceservice() -> None:
    for obj in build().values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == OWNER["metadata"]["uid"] and ref["controller"] is True


def test_servicemonitor_only_when_its_crd_exists() -> None:
    assert "ServiceMonitor" in build(monitor=True)
    assert "ServiceMonitor" not in build(monitor=False)
    assert "ServiceMonitor" not in build({"prometheus": {"serviceMonitor": {"enabled": False}}}, monitor=True)


def test_configmap_holds_every_engine_field_in_snake_case() -> None:
    built = build({"engine": {"maxNumSeqs": 32, "agingSeconds": 2.5}})
    config = json.loads(built["ConfigMap"]["data"]["engine.json"])
    assert config["max_num_seqs"] == 32 and config["aging_s"] == 2.5
    assert config["model"] == "/models/llm" and config["device"] == "cuda"


@pytest.mark.parametrize("camel", sorted(specs.ENGINE_FIELDS))
def test_only_restart_knobs_change_the_pod_template(camel: str) -> None:
    base = specs.with_defaults({"model": {"servedName": "m", "path": "/m"}})
    changed_values = {
        "maxNumSeqs": 8, "maxNumBatchedTokens": 4096, "numBuffers": 1, "kvCacheRatio": 0.5, "maxSeqLen": 1024,
        "numPriorityLevels": 2, "agingSeconds": 9, "defaultTimeoutSeconds": 30, "dtype": "bfloat16",
        "batching": "serial", "queuePolicy": "fifo", "blockSize": 32, "enablePrefixCaching": False,
        "enableChunkedPrefill": False, "simulatedDevice": {"fixedSeconds": 0.02, "perTokenSeconds": 0.001},
        "tensorParallelSize": 2, "speculative": {"method": "ngram", "numSpeculativeTokens": 3}, "maxLoras": 4,
        "maxLoraRank": 64, "maxCpuLoras": 8,
    }  # fmt: skip
    changed = specs.with_defaults({**base, "engine": {**base["engine"], camel: changed_values[camel]}})
    if camel == "enableChunkedPrefill":
        changed["engine"]["maxNumBatchedTokens"] = changed["engine"]["maxSeqLen"]
    if camel == "tensorParallelSize":
        changed["resources"]["gpus"] = 2  # one rank per GPU
    before, after = specs.check_spec(base), specs.check_spec(changed)
    hash_changed = specs.restart_hash(before) != specs.restart_hash(after)
    assert hash_changed == (specs.ENGINE_FIELDS[camel] not in LiveKnobs.names())
    assert specs.engine_json(before) != specs.engine_json(after)  # the ConfigMap always follows


def test_a_keyed_services_router_and_activator_hold_its_key() -> None:
    """sidecar.apiKeySecret: the router (routing.mode prefix) and the activator (minReplicas 0) require the pods' key
    of clients and send it on their own reads of the pods (/v1/kv-events, /v1/models), so both get it as the
    sidecar does."""
    spec = specs.with_defaults({"model": {"servedName": "llm", "path": "/models/llm"}, "routing": {"mode": "prefix"},
                                "sidecar": {"apiKeySecret": {"name": "llm-key"}}})  # fmt: skip
    specs.check_spec(spec)  # admitted
    key = {"name": "OVERLAP_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}}
    for deployment in (children.build_router("llm", "ml", spec), children.build_activator("llm", "ml", spec)):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["args"][-2:] == ["--api-key-env", "OVERLAP_API_KEY"] and key in container["env"]
    unkeyed = specs.with_defaults({"model": {"servedName": "llm", "path": "/models/llm"}})
    (container,) = children.build_router("llm", "ml", unkeyed)["spec"]["template"]["spec"]["containers"]
    assert "--api-key-env" not in container["args"] and [e["name"] for e in container["env"]] == ["HOME"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "minReplicas must be <= autoscaling.maxReplicas"),
        ({"tuning": {"bounds": {"maxNumSeqs": {"min": 100, "max": 200}}}}, "must contain engine.maxNumSeqs"),
        ({"engine": {"enableChunkedPrefill": False, "maxNumBatchedTokens": 16}}, "max_num_batched_tokens"),
        ({"engine": {"numBuffers": 9}}, "num_buffers must be in 1..4"),
        ({"model": {"servedName": "m", "path": "/m", "source": "pvc"}}, "claimName is required"),
    ],
)
def test_check_spec_catches_what_slipped_past_the_schema(spec: dict, message: str) -> None:
    full = specs.with_defaults({"model": {"servedName": "m", "path": "/m"}, **spec})
    with pytest.raises(specs.SpecError, match=message):
        specs.check_spec(full)


def test_is_subset_ignores_server_defaults_but_sees_edits() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x"}]}}}
    container = {"name": "a", "image": "x", "imagePullPolicy": "Always"}  # the server filled in a default
    actual = {"spec": {"replicas": 2, "progressDeadlineSeconds": 600, "template": {"containers": [container]}}}
    assert is_subset(desired, actual)
    actual["spec"]["template"]["containers"][0]["image"] = "y"
    assert not is_subset(desired, actual)
    assert not is_subset(desired, {"spec": {"template": {"containers": []}, "replicas": 2}})
    # Quantities come back canonical: the same amount is no drift, another amount is.
    assert is_subset({"cpu": "0.5", "memory": "1Gi"}, {"cpu": "500m", "memory": "1073741824"})
    assert not is_subset({"cpu": "0.5"}, {"cpu": "600m"})
    assert not is_subset({"image": "a:1"}, {"image": "a:2"})


def test_conditions_keep_their_transition_time_while_unchanged() -> None:
    first = [status.condition("Ready", False, "NoReplicasReady", "0/1", 1, "2026-01-01T00:00:00Z")]
    same = status.merge_conditions(first, [status.condition("Ready", False, "NoReplicasReady", "0/1", 2, "LATER")])
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and same[0]["observedGeneration"] == 2
    flipped = status.merge_conditions(first, [status.condition("Ready", True, "AllReplicasReady", "1/1", 2, "LATER")])
    assert flipped[0]["lastTransitionTime"] == "LATER"


def test_rollout_conditions_follow_the_deployment() -> None:
    deployment = {"metadata": {"generation": 2}, "status": {"observedGeneration": 2, "replicas": 2,
                                                               "updatedReplicas": 2, "readyReplicas": 1}}  # fmt: skip
    ready, progressing = status.rollout_conditions(2, deployment, 5, "T")
    assert (ready["status"], ready["reason"]) == ("True", "SomeReplicasReady")
    assert progressing["status"] == "True"
    deployment["status"]["readyReplicas"] = 2
    ready, progressing = status.rollout_conditions(2, deployment, 5, "T")
    assert (ready["reason"], progressing["status"], progressing["reason"]) == (
        "AllReplicasReady",
        "False",
        "RolloutComplete",
    )
    assert status.rollout_conditions(0, deployment, 5, "T")[0]["reason"] == "ScaledToZero"


def test_simulated_device_maps_onto_the_engines_cost_profile() -> None:
    sim = {"fixedSeconds": 0.03, "perTokenSeconds": 0.001}
    spec = specs.with_defaults({"model": {"servedName": "m", "path": "/m"}, "engine": {"simulatedDevice": sim}})
    assert specs.engine_config(spec).simulated_device == {"fixed_s": 0.03, "per_token_s": 0.001}


def _pod(name: str, ready: bool, statuses: list[dict], **extra) -> dict:
    conditions = [{"type": "Ready", "status": str(ready), **extra.pop("ready_extra", {})}]
    return {"metadata": {"name": name}, "status": {"conditions": conditions, "containerStatuses": statuses, **extra}}


def test_pod_problems_in_kubelets_words_reach_the_ready_condition() -> None:
    pull = {"name": "engine", "state": {"waiting": {"reason": "ErrImagePull", "message": "image x is not here"}}}
    crash = {"name": "sidecar", "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 3}}}  # fmt: skip
    starting = {"name": "engine", "state": {"waiting": {"reason": "ContainerCreating"}}}
    unready = {"ready_extra": {"message": "containers with unready status: [sidecar]"}}
    pods = [
        _pod("a", False, [pull]),
        _pod("b", False, [crash]),
        _pod("c", False, [starting]),  # on its way up: not a problem
        _pod("d", False, [], **unready),
        _pod("e", True, [pull]),  # ready pods are fine whatever else they say
    ]
    problems = status.pod_problems(pods)
    assert problems == [
        "pod a: container engine ErrImagePull: image x is not here",
        "pod b: container sidecar CrashLoopBackOff (exited with code 3, restarts 2)",
        "pod d: containers with unready status: [sidecar]",
    ]
    deployment = {"metadata": {"generation": 1}, "status": {"replicas": 3, "readyReplicas": 0}}
    (ready, _) = status.rollout_conditions(3, deployment, 1, "now", problems)
    assert ready["reason"] == "NoReplicasReady"
    assert (
        ready["message"] == "0/3 replicas ready; pod a: container engine ErrImagePull: image x is not here (and 2 more)"
    )


def test_a_pod_no_node_takes_reaches_the_ready_condition_in_the_schedulers_words() -> None:
    # What kube-scheduler writes on a pod it cannot place: phase Pending, no containers, PodScheduled False.
    why = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No ..."
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}
    pending = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [scheduled]}}
    assert status.pod_problems([pending]) == [f"pod p: Unschedulable: {why}"]


def test_deployment_failures_set_degraded_and_clear_it_but_leave_a_spec_problem_alone() -> None:
    stalled = {"metadata": {"generation": 2}, "status": {"observedGeneration": 2, "replicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "llm-5d" has timed out progressing.'}]}}  # fmt: skip
    owner = {"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {"observedGeneration": 1}}
    after = status.rollout_status(owner, stalled, "T")
    degraded = next(c for c in after["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ProgressDeadlineExceeded")
    assert "has timed out progressing" in degraded["message"]
    healthy = {"metadata": {"generation": 2}, "status": {"observedGeneration": 2, "replicas": 1, "readyReplicas": 1}}
    cleared = status.rollout_status({**owner, "status": after}, healthy, "T")
    assert next(c for c in cleared["conditions"] if c["type"] == "Degraded")["status"] == "False"
    spec_problem = status.degraded_status(owner, "spec.engine: bad", "T")
    kept = status.rollout_status({**owner, "status": spec_problem}, healthy, "T")
    assert next(c for c in kept["conditions"] if c["type"] == "Degraded")["reason"] == "InvalidSpec"
    quota = {"status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                        "message": "exceeded quota: gpu"}]}}  # fmt: skip
    assert status.deployment_degraded(quota, 1, "T")["reason"] == "ReplicaFailure"


POD_OVERRIDES = {
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-high",
    "serviceAccountName": "llm-reader",
    "labels": {"team": "search", "app.kubernetes.io/name": "not-ours"},
    "annotations": {"sidecar.istio.io/inject": "false", "prometheus.io/port": "1"},
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "OMP_NUM_THREADS", "value": "2"}],
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
    "startupSeconds": 900,
    "volumes": [{"name": "adapters", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}}],
    "volumeMounts": [{"name": "adapters", "mountPath": "/adapters", "readOnly": True}],
}


def test_pod_overrides_reach_the_template_and_never_replace_the_operators_own() -> None:
    built = build({"pod": POD_OVERRIDES, "prometheus": {"serviceMonitor": {"labels": {"release": "kps"}}}})
    template = built["Deployment"]["spec"]["template"]
    pod = template["spec"]
    assert (pod["runtimeClassName"], pod["priorityClassName"], pod["serviceAccountName"]) == (
        "nvidia", "inference-high", "llm-reader")  # fmt: skip
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    assert pod["automountServiceAccountToken"] is False
    assert template["metadata"]["labels"]["team"] == "search"
    assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "overlap"  # the selector stays ours
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    engine, sidecar = containers(built["Deployment"])["engine"], containers(built["Deployment"])["sidecar"]
    env = {item["name"]: item.get("value") for item in engine["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == "2" and env["HOME"] == "/tmp"
    assert len(engine["env"]) == len(env)  # one entry per name
    assert "HF_HUB_OFFLINE" in {item["name"] for item in sidecar["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "loras" and "socket" in volumes
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in engine["volumeMounts"]
    assert "/adapters" not in {m["mountPath"] for m in sidecar["volumeMounts"]}  # the engine reads adapters
    kubernetes_validate.validate(built["Deployment"], K8S_VERSION, strict=True)
    probe = engine["startupProbe"]
    assert probe["exec"]["command"][:3] == ["python", "-m", "overlap.engine.serving.probe"]
    assert 900 <= probe["periodSeconds"] * probe["failureThreshold"] < 910
    assert built["ServiceMonitor"]["metadata"]["labels"]["release"] == "kps"
    assert built["ServiceMonitor"]["metadata"]["labels"]["app.kubernetes.io/managed-by"] == identity.MANAGED_BY
    default = containers(build()["Deployment"])
    assert "startupProbe" not in default["sidecar"] and "startupProbe" not in sidecar  # the engine holds the GPU
    budget = default["engine"]["startupProbe"]
    assert budget["periodSeconds"] * budget["failureThreshold"] == children.DEFAULT_STARTUP_S
    assert default["engine"]["livenessProbe"]["exec"] == probe["exec"]


def test_the_rollout_strategy_follows_the_spec_and_refuses_one_that_can_never_move() -> None:
    default = build()["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert default == {"maxSurge": 1, "maxUnavailable": 0}  # surge first: a serving pod goes only once a new one is up
    full_pool = build({"rollout": {"maxSurge": 0, "maxUnavailable": 1}})["Deployment"]["spec"]["strategy"]
    assert full_pool["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    with pytest.raises(specs.SpecError, match="cannot both be 0"):
        build({"rollout": {"maxSurge": "0%", "maxUnavailable": 0}})


def test_a_service_that_scales_to_zero_gets_an_activator_and_routes_to_it_while_at_zero() -> None:
    spec = specs.with_defaults({
        "model": {"servedName": "llm", "path": "/models/llm"},
        "replicas": 0,
        "autoscaling": {"mode": "builtin", "minReplicas": 0},
    })  # fmt: skip
    config = specs.check_spec(spec)
    built = {
        (o["kind"], o["metadata"]["name"]): o
        for o in children.build_children(OWNER, spec, config, with_servicemonitor=True)
    }
    for obj in built.values():
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    activator, pods = built[("Deployment", "llm-activator")], built[("Service", "llm-pods")]
    engine = built[("Deployment", "llm")]
    activator_labels = activator["spec"]["template"]["metadata"]["labels"]
    # neither Deployment's selector matches the other's pods
    assert not is_subset(engine["spec"]["selector"]["matchLabels"], activator_labels)
    assert not is_subset(activator["spec"]["selector"]["matchLabels"], engine["spec"]["template"]["metadata"]["labels"])
    args = activator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["activator", "--upstream", "http://llm-pods.ml.svc:8000"]
    assert "nvidia.com/gpu" not in json.dumps(activator)  # the activator never holds a GPU
    assert pods["spec"]["selector"] == identity.selector_labels("llm")
    # the ServiceMonitor selects Services by the selector labels: the pods' Service must not match (double scrape)
    assert not is_subset(
        built[("ServiceMonitor", "llm")]["spec"]["selector"]["matchLabels"], pods["metadata"]["labels"]
    )
    public = built[("Service", "llm")]
    assert public["spec"]["selector"] == identity.activator_labels("llm")  # no replica: the activator answers
    order = [key for key in built]
    assert order.index(("Service", "llm")) < order.index(("Deployment", "llm"))  # routed away before pods go
    serving = {**OWNER, "status": {"readyReplicas": 1}}
    spec_one = {**spec, "replicas": 1}
    routed = [
        o
        for o in children.build_children(serving, spec_one, config, with_servicemonitor=False)
        if o["kind"] == "Service"
    ]
    assert {o["metadata"]["name"]: o["spec"]["selector"] for o in routed}["llm"] == identity.selector_labels("llm")
    # a service with a floor of one replica has neither
    plain = build({"autoscaling": {"mode": "builtin", "minReplicas": 1}})
    assert plain["Service"]["spec"]["selector"] == identity.selector_labels("llm")
    assert plain["Deployment"]["metadata"]["name"] == "llm"


def test_the_pods_service_of_a_63_character_name_is_still_a_dns_label():
    import re

    from overlap.operator.identity import pods_service_name

    dns_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    assert pods_service_name("llm") == "llm-pods"
    names = ["a" * 58, "a" * 59, "a" * 62 + "b", "a" * 62 + "c"]  # the CRD allows names of up to 63 characters
    services = [pods_service_name(n) for n in names]
    assert services[0] == "a" * 58 + "-pods"
    assert all(len(s) <= 63 and dns_1035.match(s) for s in services), services
    assert len(set(services)) == len(services)  # names that differ only past the cut stay apart


def test_a_cold_gpu_start_gets_a_progress_deadline_that_covers_it() -> None:
    # Kubernetes' default of 600 s would call a normal cold start (an image of several GB, a model load) stuck.
    # The deadline covers the start kubelet allows the engine (startupSeconds, default 3600 s) and the image pull:
    # a rollout is not called stuck while a pod may still legitimately be starting.
    assert build()["Deployment"]["spec"]["progressDeadlineSeconds"] == children.DEFAULT_STARTUP_S + 600
    slow = build({"pod": {"startupSeconds": 7200}})["Deployment"]["spec"]
    assert slow["progressDeadlineSeconds"] == 7200 + 600
    quick = build({"pod": {"startupSeconds": 300}})["Deployment"]["spec"]
    assert quick["progressDeadlineSeconds"] == 300 + 600


def test_the_default_pod_fits_a_4_vcpu_16_gib_gpu_node_beside_its_daemons() -> None:
    from tests.support.node_agent import cpu_quantity, memory_bytes

    pod = build()["Deployment"]["spec"]["template"]["spec"]
    requests = [c["resources"]["requests"] for c in pod["containers"]]
    # g4dn.xlarge, g5.xlarge and g2-standard-4 leave about 3.9 CPUs and 12-14 GiB allocatable, less their daemons
    assert sum(cpu_quantity(r["cpu"]) for r in requests) <= 3
    assert sum(memory_bytes(r["memory"]) for r in requests) <= 11 << 30


def test_probe_timeouts_hold_under_load() -> None:
    # kubelet's default timeout is 1 s: a sidecar busy streaming (1 CPU) misses it, and its liveness restart cuts
    # every stream of the pod
    built = build({"autoscaling": {"mode": "builtin", "minReplicas": 0}})
    for deployment in (built["Deployment"],):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                if kind in container:
                    assert container[kind].get("timeoutSeconds", 1) >= 5, (container["name"], kind)


def test_pod_env_takes_value_from_and_writes_no_empty_value_the_api_server_would_drop() -> None:
    from overlap.operator.drift import is_subset

    env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "EMPTY", "value": ""}, {"name": "PLAIN", "value": "1"}]  # fmt: skip
    deployment = build({"pod": {"env": env}})["Deployment"]
    engine = {item["name"]: item for item in containers(deployment)["engine"]["env"]}
    assert engine["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert engine["EMPTY"] == {"name": "EMPTY"} and engine["PLAIN"] == {"name": "PLAIN", "value": "1"}
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    # what the API server returns: Go's omitempty drops an empty value; the drift check must see no change
    returned = json.loads(json.dumps(deployment).replace('"value": ""', '"value": null'))
    for container in returned["spec"]["template"]["spec"]["containers"]:
        container["env"] = [{k: v for k, v in item.items() if v is not None} for item in container["env"]]
    assert is_subset(deployment, returned)


@pytest.mark.parametrize(("deployment_ready", "routed_to"), [(1, "pods"), (0, "activator")])
def test_a_reconcile_routes_a_scale_to_zero_service_by_the_deployment_not_a_stale_status(
    monkeypatch, deployment_ready: int, routed_to: str
) -> None:
    """The status still says 0 ready (mirrored before the pod became ready): the Service follows the Deployment."""
    from overlap.operator import admin_tokens, kube, reconcile

    service = {**OWNER, "spec": {"model": {"servedName": "m", "path": "/m"}, "replicas": 1,
                                 "autoscaling": {"mode": "builtin", "minReplicas": 0}},
               "status": {"readyReplicas": 0}}  # fmt: skip
    applied = []
    monkeypatch.setattr(admin_tokens, "ensure", lambda owner: (None, False))
    monkeypatch.setattr(kube, "read", lambda kind, name, ns: {"status": {"readyReplicas": deployment_ready}})
    monkeypatch.setattr(kube, "apply", lambda obj: applied.append(obj) or "unchanged")
    monkeypatch.setattr(kube, "delete_if_owned", lambda *args: False)
    monkeypatch.setattr(kube, "list_pods", lambda *args: [])
    monkeypatch.setattr(kube, "patch_status", lambda *args: None)
    reconcile.apply(reconcile.desired(service, with_servicemonitor=False), service, lambda *args: None)
    (public,) = [o for o in applied if o["kind"] == "Service" and o["metadata"]["name"] == "llm"]
    wanted = identity.selector_labels("llm") if routed_to == "pods" else identity.activator_labels("llm")
    assert public["spec"]["selector"] == wanted


def test_a_routed_service_gets_a_router_in_front_of_a_headless_service_of_its_pods() -> None:
    """routing.mode prefix: the public Service selects the router's pod; the router finds the engine pods as the
    addresses of a headless Service; at minReplicas 0 the router holds requests itself (no activator); the
    ServiceMonitor scrapes both, each labelled with the InferenceService's name."""
    spec = specs.with_defaults({
        "model": {"servedName": "llm", "path": "/models/llm"},
        "replicas": 0,
        "autoscaling": {"mode": "builtin", "minReplicas": 0},
        "routing": {"mode": "prefix", "sessionHeader": "x-conversation", "routerReplicas": 2},
    })  # fmt: skip
    built = {
        (o["kind"], o["metadata"]["name"]): o
        for o in children.build_children(OWNER, spec, specs.check_spec(spec), with_servicemonitor=True)
    }
    for obj in built.values():
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert ("Deployment", "llm-activator") not in built and ("Service", "llm-pods") not in built
    router, replicas = built[("Deployment", "llm-router")], built[("Service", "llm-replicas")]
    engine = built[("Deployment", "llm")]
    assert built[("Service", "llm")]["spec"]["selector"] == identity.router_labels("llm")
    assert replicas["spec"]["clusterIP"] == "None" and replicas["spec"]["selector"] == identity.selector_labels("llm")
    router_pod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not is_subset(engine["spec"]["selector"]["matchLabels"], router_pod_labels)
    assert not is_subset(router["spec"]["selector"]["matchLabels"], engine["spec"]["template"]["metadata"]["labels"])
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["router", "--replicas-from", "llm-replicas.ml.svc:8000"]
    assert container["args"][container["args"].index("--session-header") + 1] == "x-conversation"
    assert container["readinessProbe"]["httpGet"]["path"] == "/router/healthz"  # ready with no replica: it holds
    assert router["spec"]["replicas"] == 2
    assert "nvidia.com/gpu" not in json.dumps(router)
    order = list(built)
    assert order.index(("Service", "llm-replicas")) < order.index(("Deployment", "llm-router"))
    monitor = built[("ServiceMonitor", "llm")]
    selected = [key for key, o in built.items() if o["kind"] == "Service"
                and is_subset(monitor["spec"]["selector"]["matchLabels"], o["metadata"]["labels"])]  # fmt: skip
    assert sorted(selected) == [("Service", "llm"), ("Service", "llm-replicas")]
    relabel = monitor["spec"]["endpoints"][0]["relabelings"][0]
    assert relabel["targetLabel"] == "service" and relabel["sourceLabels"] == [children.SERVICE_LABEL_META]
    assert children.SERVICE_LABEL_META == "__meta_kubernetes_service_label_overlap_dev_inferenceservice"
    with pytest.raises(specs.SpecError, match=r"routing\.mode"):
        specs.check_spec({**spec, "routing": {"mode": "nearest"}})


def test_the_router_and_the_activator_go_when_the_spec_no_longer_wants_them() -> None:
    from overlap.operator import reconcile

    def unwanted(spec: dict) -> set[tuple[str, str]]:
        service = {**OWNER, "spec": {"model": {"servedName": "llm", "path": "/models/llm"}, **spec}}
        return {(kind, name) for kind, name, _ in reconcile.desired(service, with_servicemonitor=False).unwanted}

    to_zero = {"autoscaling": {"mode": "builtin", "minReplicas": 0}}
    router = {("Deployment", "llm-router"), ("Service", "llm-replicas")}
    activator = {("Deployment", "llm-activator"), ("Service", "llm-pods")}
    assert router <= unwanted(to_zero) and not activator & unwanted(to_zero)
    assert activator <= unwanted({**to_zero, "routing": {"mode": "prefix"}})
    assert not router & unwanted({**to_zero, "routing": {"mode": "prefix"}})


def test_a_reconcile_plans_from_the_service_as_read_under_its_lock(monkeypatch):
    """kopf hands a handler the object as its event saw it; a control tick may have retuned since (status.liveKnobs,
    which the ConfigMap is built from). The plan comes from the service read under the lock, so the older knobs are
    not written back; a service deleted meanwhile is left alone."""
    import logging

    from overlap.operator import handlers, kube
    from overlap.operator import reconcile as plans

    meta = {"name": "llm", "namespace": "ns", "uid": "u1"}
    seen = {"metadata": meta, "spec": {}, "status": {"liveKnobs": {"maxNumSeqs": 16}}}
    retuned = {"metadata": meta, "spec": {}, "status": {"liveKnobs": {"maxNumSeqs": 4}}}
    planned = []
    monkeypatch.setattr(kube, "api_groups", lambda: set())
    monkeypatch.setattr(plans, "desired", lambda body, **_: planned.append(body) or "plan")
    monkeypatch.setattr(plans, "apply", lambda *args: None)
    monkeypatch.setattr(kube, "read_service", lambda name, namespace: retuned)
    handlers._reconcile_children(seen, logging.getLogger("test"), None)
    assert planned == [retuned]
    monkeypatch.setattr(kube, "read_service", lambda name, namespace: None)
    handlers._reconcile_children(seen, logging.getLogger("test"), None)
    assert planned == [retuned]
