"""model.uri in the pod the operator builds: the fetch init container, the cache volume, the link the engine reads;
a pvc:// claim mounted; ModelReady from the fetch's state. Checked without Kubernetes (and strictly against the
pod schema)."""

from __future__ import annotations

import kubernetes_validate
import pytest

from overlap.operator import children, status
from overlap.operator import spec as specs

OWNER = {
    "apiVersion": "overlap.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llm", "namespace": "ml", "uid": "0f6c1c1e-0000-4000-8000-000000000001", "generation": 1},
}


def pod_of(model: dict, **spec) -> tuple[dict, dict]:
    """(the pod spec, the engine config) built for this model section."""
    full = specs.with_defaults({"model": {"servedName": "llm", **model}, **spec})
    config = specs.check_spec(full)
    (deployment,) = [
        o for o in children.build_children(OWNER, full, config, with_servicemonitor=False) if o["kind"] == "Deployment"
    ]
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    return deployment["spec"]["template"]["spec"], config


def test_a_hub_uri_gets_a_fetch_init_container_on_the_nodes_cache_and_the_engine_reads_its_link():
    pod, config = pod_of({"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct", "secretRef": {"name": "hf"}},
                         pod={"env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]})  # fmt: skip
    (fetch,) = pod["initContainers"]
    assert fetch["args"] == ["model", "fetch", "hf://Qwen/Qwen2.5-0.5B-Instruct", "--cache-dir", specs.MODEL_CACHE_DIR,
                             "--link", specs.MODEL_LINK]  # fmt: skip
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf"}}]
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in fetch["env"]
    assert fetch["image"] == pod["containers"][0]["image"]  # the engine image carries `overlap model fetch`
    assert fetch["securityContext"]["runAsUser"] == 0  # a hostPath is created root-owned; fsGroup never reaches it
    assert fetch["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"]["hostPath"] == {
        "path": specs.DEFAULT_MODEL_CACHE_HOSTPATH,
        "type": "DirectoryOrCreate",
    }
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["model-cache"]["readOnly"] and mounts["model-link"]["readOnly"]
    assert config.model == specs.MODEL_LINK


def test_a_shared_claim_cache_runs_the_fetch_as_the_engines_user_and_bounds_the_cache():
    pod, _ = pod_of({"uri": "s3://models/qwen", "cache": {"claimName": "model-cache", "maxSizeGi": 100}})
    (fetch,) = pod["initContainers"]
    assert fetch["securityContext"].get("runAsUser") is None  # the pod's user; its fsGroup owns the claim
    assert fetch["args"][-2:] == ["--max-cache-gb", "107.374"]
    assert {v["name"]: v for v in pod["volumes"]}["model-cache"]["persistentVolumeClaim"] == {
        "claimName": "model-cache"
    }


def test_a_pvc_uri_mounts_the_claim_and_reads_the_path_in_it():
    pod, config = pod_of({"uri": "pvc://weights/llama-3.1-8b"})
    assert "initContainers" not in pod
    volume = {v["name"]: v for v in pod["volumes"]}["model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert config.model == "/models/llama-3.1-8b"


def test_an_oci_image_is_fetched_with_its_registry_secret_as_a_docker_config():
    pod, config = pod_of({"uri": "oci://ghcr.io/acme/qwen:v1", "secretRef": {"name": "ghcr"}})
    (fetch,) = pod["initContainers"]
    assert fetch["args"][:3] == ["model", "fetch", "oci://ghcr.io/acme/qwen:v1"] and "envFrom" not in fetch
    assert {"name": "DOCKER_CONFIG", "value": specs.REGISTRY_CONFIG_DIR} in fetch["env"]
    secret = {v["name"]: v for v in pod["volumes"]}["registry-config"]["secret"]
    assert secret == {"secretName": "ghcr", "items": [{"key": ".dockerconfigjson", "path": "config.json"}]}
    assert "registry-config" not in {m["name"] for m in pod["containers"][0]["volumeMounts"]}  # the fetch's only
    assert config.model == specs.MODEL_LINK


def test_an_oci_image_volume_is_pulled_by_kubelet_with_the_pull_secret_and_read_at_models():
    digest = "sha256:" + "c" * 64
    pod, config = pod_of({"uri": f"oci://ghcr.io/acme/qwen:v1@{digest}", "imageVolume": True,
                          "secretRef": {"name": "ghcr"}}, images={"pullSecrets": ["ghcr", "other"]})  # fmt: skip
    assert "initContainers" not in pod
    volume = {v["name"]: v for v in pod["volumes"]}["model"]
    assert volume["image"] == {"reference": f"ghcr.io/acme/qwen:v1@{digest}", "pullPolicy": "IfNotPresent"}
    assert pod["imagePullSecrets"] == [{"name": "ghcr"}, {"name": "other"}]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert {"name": "model", "mountPath": specs.MODEL_IMAGE_DIR, "readOnly": True} in engine["volumeMounts"]
    assert config.model == f"{specs.MODEL_IMAGE_DIR}/models"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"path": "/m", "uri": "hf://a/b"}, "set exactly one of model.path and model.uri"),
        ({}, "set exactly one of model.path and model.uri"),
        ({"uri": "hf://just-a-name"}, "model.uri 'hf://just-a-name': expected hf://ORG/NAME"),
        ({"uri": "hf://a/b", "source": "pvc", "claimName": "c"}, "a uri names its own source"),
        ({"uri": "hf://a/b", "cache": {"claimName": "c", "hostPath": "/c"}}, "claimName or a hostPath, not both"),
        ({"uri": "hf://a/b", "imageVolume": True}, "model.imageVolume goes with an oci:// model.uri"),
        ({"uri": "oci://ghcr.io/Acme/Qwen"}, "expected oci://REGISTRY/REPOSITORY"),
    ],
)
def test_the_operator_refuses_what_the_schema_would(model: dict, message: str) -> None:
    with pytest.raises(specs.SpecError, match=message):
        specs.check_spec(specs.with_defaults({"model": {"servedName": "m", **model}}))


def _pod(name: str, fetch: dict) -> dict:
    return {"metadata": {"name": name}, "status": {"initContainerStatuses": [{"name": "fetch", **fetch}]}}


def test_model_ready_follows_the_fetch_init_containers():
    def model(pods, progress=None):
        return status.model_condition(pods, "fetch", "hf://a/b", "T", 1, progress)

    assert model([])["status"] == "Unknown"
    running = _pod("p1", {"state": {"running": {}}})
    fetching = model([running], {"p1": "hf://a/b: fetching, 1.20 of 5.00 GB (850 MB/s)"})
    assert (fetching["status"], fetching["reason"]) == ("False", "Fetching") and "1.20 of 5.00 GB" in fetching[
        "message"
    ]
    last = {"terminated": {"exitCode": 1, "reason": "Error", "message": "hf://a/b: 401 Client Error"}}
    failed = _pod("p2", {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": last})
    crashed = model([failed])
    assert (crashed["reason"], crashed["message"]) == ("FetchFailed", "pod p2: hf://a/b: 401 Client Error")
    done = _pod("p3", {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}})
    assert model([failed, done])["status"] == "True"  # one pod has it: the model is reachable
    # Retrying, the fetch runs again: ModelReady keeps the failure, and so does the Ready condition's pod problem.
    retrying = _pod("p4", {"state": {"running": {}}, "restartCount": 1, "lastState": last})
    assert model([retrying])["reason"] == "FetchFailed"
    assert status.pod_problems([retrying]) == [
        "pod p4: init container fetch running again after Error (exited with code 1, restarts 1): "
        "hf://a/b: 401 Client Error"
    ]


def test_model_ready_during_a_rollout_to_another_uri_reads_only_the_pods_fetching_it(monkeypatch):
    """The old ReplicaSet's pods have the last uri: a new uri whose fetch fails is not ready because they are."""
    from overlap.operator import handlers, kube
    from overlap.operator.model_volumes import fetch_args

    spec = {"model": {"servedName": "m", "uri": "hf://acme/new"}}
    old_args = fetch_args(specs.with_defaults({"model": {"servedName": "m", "uri": "hf://acme/old"}}))
    new_args = fetch_args(specs.with_defaults(spec))
    assert old_args != new_args

    def pod(name: str, args: list[str], fetch: dict) -> dict:
        return {**_pod(name, fetch), "spec": {"initContainers": [{"name": "fetch", "args": args}]}}

    done = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    last = {"terminated": {"exitCode": 1, "reason": "Error", "message": "hf://acme/new: 404 Client Error"}}
    failing = {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": last}
    pods = [pod("old-1", old_args, done), pod("old-2", old_args, done), pod("new-1", new_args, failing)]
    owner = {"metadata": {"name": "m", "namespace": "ns"}, "spec": spec, "status": {"observedGeneration": 2}}
    written = []
    monkeypatch.setattr(kube, "list_pods", lambda namespace, selector: pods)
    monkeypatch.setattr(kube, "log_tail", lambda *args, **kwargs: "")
    monkeypatch.setattr(kube, "patch_status", lambda name, namespace, compute: written.append(compute(owner)))

    def model_ready() -> dict:
        handlers._mirror(owner, None)
        return next(c for c in written[-1]["conditions"] if c["type"] == "ModelReady")

    ready = model_ready()
    assert (ready["status"], ready["reason"]) == ("False", "FetchFailed"), ready
    assert ready["message"] == "pod new-1: hf://acme/new: 404 Client Error"
    pods[2] = pod("new-1", new_args, done)  # fixed: the new pod has it
    ready = model_ready()
    assert (ready["status"], ready["message"]) == ("True", "hf://acme/new is in the cache of 1 pod(s)")
