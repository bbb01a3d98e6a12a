"""spec.adapters: the pod the operator builds for them, and adapters loaded into and unloaded from a running pod
through its API without rolling the Deployment.

The pod's API is a real `overlap serve --enable-lora --allow-runtime-lora-updating true` on the tiny model (one for
the module), with adapters PEFT made on it; what the pod's adapters container would have fetched is a link in the
links folder to such an adapter. The operator, kopf, the kubernetes client and the emulated API server are the
real ones.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import kopf
import kubernetes_validate
import pytest
import yaml

from overlap.engine.delivery.adapters import link_name
from overlap.engine.errors import ADAPTER_NOT_FOUND
from overlap.operator import adapter_sync, adapters, admin_tokens, children, kube, reconcile
from overlap.operator import spec as specs
from tests.support.cluster import NAMESPACE, chart_grants, not_granted, operator_requests, wait_for
from tests.support.lora import make_adapter
from tests.support.model_sources import HubServer
from tests.support.sidecar import ADMIN_TOKEN, http, overlap_cmd, overlap_serve

OWNER = {
    "apiVersion": "overlap.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llm", "namespace": "ml", "uid": "0f6c1c1e-0000-4000-8000-00000000000a", "generation": 1},
}
MODEL = {"servedName": "llm", "path": "/models/llm"}
SQL = {"name": "sql", "uri": "hf://acme/sql-lora"}
CHAT = {"name": "chat", "uri": "s3://loras/chat"}
MATH = {"name": "math", "uri": "oci://registry.example/loras/math:v1"}
GONE = {"name": "gone", "uri": "hf://acme/missing-lora"}


def built(spec: dict) -> dict[tuple[str, str], dict]:
    full = specs.with_defaults({"model": MODEL, **spec})
    made = children.build_children(OWNER, full, specs.check_spec(full), with_servicemonitor=False)
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in made}


def pod_spec(spec: dict) -> dict:
    return built(spec)[("Deployment", "llm")]["spec"]["template"]["spec"]


LORA_SIZES = {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8}


def test_the_engines_lora_sizes_reach_the_pods_engine(tmp_path) -> None:
    """spec.engine.maxLoras, maxLoraRank and maxCpuLoras through the CRD's schema into the ConfigMap's engine.json,
    read as the pod's engine reads it (its file, then its --enable-lora)."""
    from overlap.engine.serving.server import load_engine_config
    from tests.operator.test_crd import SCHEMA, refusal, with_spec
    from tests.support.kube import admission

    stored = specs.with_defaults(
        admission.admit(with_spec(engine=LORA_SIZES, adapters=[SQL]), SCHEMA, strict=True)["spec"]
    )
    objects = children.build_children(OWNER, stored, specs.check_spec(stored), with_servicemonitor=False)
    config_map = next(obj for obj in objects if obj["kind"] == "ConfigMap" and "engine.json" in obj["data"])
    (tmp_path / "engine.json").write_text(config_map["data"]["engine.json"])
    engine = load_engine_config(tmp_path / "engine.json", None, {"enable_lora": True})
    assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (4, 64, 8) and engine.enable_lora
    defaulted = admission.admit(with_spec(adapters=[SQL]), SCHEMA, strict=True)["spec"]
    config = specs.check_spec(defaulted)
    assert (config.max_loras, config.max_lora_rank, config.num_cpu_loras) == (1, 16, 1)  # the engine's defaults
    assert (
        specs.check_spec(
            admission.admit(with_spec(engine={"maxLoraRank": 1}), SCHEMA, strict=True)["spec"]
        ).max_lora_rank
        == 1
    )

    for field in LORA_SIZES:  # below 1: the API server refuses, and so would the engine
        assert f"spec.engine.{field} in body should be greater than or equal to 1" in refusal(with_spec(engine={
            field: 0}))  # fmt: skip
    fewer = {"maxLoras": 4, "maxCpuLoras": 2}
    assert "engine.maxCpuLoras must be >= engine.maxLoras" in refusal(with_spec(engine=fewer))
    with pytest.raises(specs.SpecError, match=r"engine\.maxCpuLoras must be >= engine\.maxLoras"):
        specs.check_spec(specs.with_defaults(with_spec(engine=fewer)["spec"]))


def test_a_pod_with_adapters_runs_the_engine_with_lora_and_an_adapters_container_on_the_models_cache() -> None:
    objects = built({"adapters": [SQL, CHAT]})
    pod = pod_spec({"adapters": [SQL, CHAT]})
    by_name = {c["name"]: c for c in pod["containers"]}
    assert by_name["engine"]["args"][-1] == "--enable-lora"
    # the operator loads them through the admin port: the public port's runtime-updating routes stay off
    assert not [e for e in by_name["sidecar"]["env"] if e["name"] == "VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    assert "--allow-runtime-lora-updating" not in by_name["sidecar"]["args"]
    fetcher = by_name["adapters"]
    assert fetcher["args"][:4] == ["model", "fetch-adapters", adapters.LIST_FILE, "--watch"]
    assert {m["mountPath"] for m in by_name["engine"]["volumeMounts"]} >= {adapters.LINK_DIR, specs.MODEL_CACHE_DIR}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapter-list"]["configMap"]["name"] == "llm-adapters"
    assert volumes["model-cache"]["hostPath"]["path"] == specs.DEFAULT_MODEL_CACHE_HOSTPATH
    listed = json.loads(objects[("ConfigMap", "llm-adapters")]["data"]["adapters.json"])
    assert listed == {"sql": SQL["uri"], "chat": CHAT["uri"]}
    for obj in objects.values():
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)

    # a fetched model brings the cache (a shared claim here): the adapters use it, the pod has it once
    fetched = {"servedName": "llm", "uri": "hf://acme/base", "cache": {"claimName": "models"}}
    pod = pod_spec({"model": fetched, "adapters": [SQL]})
    assert [v["name"] for v in pod["volumes"]].count("model-cache") == 1
    assert {c["name"]: c for c in pod["containers"]}["adapters"]["securityContext"]["runAsNonRoot"] is True

    # model.secretRef reaches the adapters' fetch as it reaches the model's: environment, or an oci:// registry login
    keyed = {"servedName": "llm", "uri": "hf://acme/base", "secretRef": {"name": "hf-token"}}
    fetcher = {c["name"]: c for c in pod_spec({"model": keyed, "adapters": [SQL]})["containers"]}["adapters"]
    assert fetcher["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    for image_volume in (False, True):
        oci = {"servedName": "llm", "uri": "oci://registry.example/base:v1", "secretRef": {"name": "login"},
               "imageVolume": image_volume}  # fmt: skip
        pod = pod_spec({"model": oci, "adapters": [MATH]})
        fetcher = {c["name"]: c for c in pod["containers"]}["adapters"]
        assert {"name": "DOCKER_CONFIG", "value": specs.REGISTRY_CONFIG_DIR} in fetcher["env"]
        assert [v["name"] for v in pod["volumes"]].count("registry-config") == 1
        assert "envFrom" not in fetcher

    plain = pod_spec({})
    assert "--enable-lora" not in plain["containers"][0]["args"] and len(plain["containers"]) == 2


def test_changing_the_adapter_list_changes_the_configmap_never_the_pod_template() -> None:
    two, three = built({"adapters": [SQL, CHAT]}), built({"adapters": [SQL, CHAT, MATH]})
    assert two[("Deployment", "llm")] == three[("Deployment", "llm")]
    assert two[("ConfigMap", "llm-adapters")] != three[("ConfigMap", "llm-adapters")]
    assert two[("ConfigMap", "llm-engine")] == three[("ConfigMap", "llm-engine")]  # engine.json: the control loop's
    service = {**OWNER, "spec": {"model": MODEL}}
    unwanted = reconcile.desired(service, with_servicemonitor=False).unwanted
    assert ("ConfigMap", "llm-adapters") in {(kind, name) for kind, name, _ in unwanted}


@pytest.fixture(scope="module")
def lora_pod(tiny_model_dir, tmp_path_factory) -> Iterator[dict]:
    """A real pod API (`overlap serve --enable-lora`, its admin port behind ADMIN_TOKEN; the public runtime-updating
    routes off, as the operator's pods run it), and a PEFT adapter on its model to link."""
    folder = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "peft", 4, 8, False,
                          ["q_proj", "v_proj"], seed=5)  # fmt: skip
    config = "num_kv_blocks: 64\nnum_threads: 1\nmax_seq_len: 64\n"
    flags = ("--enable-lora", "--max-lora-rank", "4")
    with overlap_serve(tiny_model_dir, "engine.yaml", config, *flags) as server:
        yield {**server, "adapter": folder, "port": int(server["url"].rsplit(":", 1)[1])}


def fetched(lora_pod: dict, path: str) -> None:
    """What the pod's adapters container does once an adapter is fetched: its link, to the adapter's folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).symlink_to(lora_pod["adapter"], target_is_directory=True)


def test_a_pass_loads_what_is_listed_unloads_what_is_not_and_moves_an_adapter_whose_uri_changed(
    lora_pod, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(adapters, "LINK_DIR", str(tmp_path / "links"))  # the pod's links folder, here
    calls = []
    real_call = adapter_sync._call

    def call(url, token, body, timeout_s):  # the operator's calls, recorded on their way to the real API
        calls.append((url.rsplit("/", 1)[-1], *(body or {}).values()))
        return real_call(url, token, body, timeout_s)

    monkeypatch.setattr(adapter_sync, "_call", call)
    wanted = adapters.paths({"adapters": [SQL, CHAT]})
    assert wanted["sql"] == f"{tmp_path}/links/{link_name('sql', SQL['uri'])}"
    url = lora_pod["admin"]
    with pytest.raises(adapter_sync.PodAPIError, match=r"^401: a valid admin bearer token is required"):
        adapter_sync.sync_pod(url, "not-the-token", wanted)  # the admin port, not anyone who reaches the pod
    public = http("POST", f"{lora_pod['url']}/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": wanted["sql"]})
    assert public[0] == 403  # and the public port's runtime-updating routes stay off
    sync_pod = functools.partial(adapter_sync.sync_pod, url, ADMIN_TOKEN)
    fetched(lora_pod, wanted["sql"])  # chat still fetching
    states = sync_pod(wanted)
    assert states["sql"] == (adapter_sync.LOADED, "")
    assert states["chat"][0] == adapter_sync.NOT_LOADED
    assert states["chat"][1].startswith(f"400: adapter 'chat': no adapter_config.json in '{wanted['chat']}'")
    fetched(lora_pod, wanted["chat"])
    assert sync_pod(wanted) == {n: (adapter_sync.LOADED, "") for n in wanted}
    calls.clear()
    assert sync_pod(wanted) == {n: (adapter_sync.LOADED, "") for n in wanted}
    assert calls == [("lora",)]  # nothing to do: nothing called but GET /admin/lora

    moved = adapters.paths({"adapters": [{**SQL, "uri": "hf://acme/sql-lora@v2"}]})
    calls.clear()  # the new uri not fetched yet: the old folder keeps serving
    states = sync_pod(moved)
    assert states["sql"][0] == adapter_sync.NOT_LOADED and "no adapter_config.json" in states["sql"][1]
    assert sorted(calls[1:]) == [("load", "sql", moved["sql"], True), ("unload", "chat")]
    assert adapter_sync.served_adapters(url, ADMIN_TOKEN) == {"sql": wanted["sql"]}
    fetched(lora_pod, moved["sql"])
    calls.clear()
    assert sync_pod(moved) == {"sql": (adapter_sync.LOADED, "")}
    assert calls[1:] == [("load", "sql", moved["sql"], True)]  # moved in place, never unloaded
    assert adapter_sync.served_adapters(url, ADMIN_TOKEN) == moved
    with pytest.raises(adapter_sync.PodAPIError, match=r"^404: "):  # not our admin API there: said, not crashed
        adapter_sync.sync_pod(f"{url}/elsewhere", ADMIN_TOKEN, moved)


class PassKube:
    """The kube calls of a pass, in memory: the service, and one ready pod at loopback where `lora_pod` answers;
    `on_pass(n)` runs as pass n (from 1) lists the pods, and `delays` holds the retry delay each pass ran after."""

    def __init__(self, lora_pod: dict, listed: list[dict], on_pass=lambda n: None) -> None:
        admin_port = int(lora_pod["admin"].rsplit(":", 1)[1])
        spec = {"model": MODEL, "sidecar": {"port": lora_pod["port"], "adminPort": admin_port}, "adapters": listed}
        self.owner: dict | None = {**OWNER, "spec": spec}
        self.on_pass, self.delays, self.log = on_pass, [], ""
        self.pod = {"metadata": {"name": "llm-0"},
                    "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip

    def list_pods(self, namespace, selector):
        self.delays.append(adapter_sync._WAITS.get(OWNER["metadata"]["uid"], (None, None))[1])
        self.on_pass(len(self.delays))
        return [self.pod]

    def read_service(self, name, namespace):
        return self.owner

    def patch_status(self, name, namespace, compute):
        self.owner = {**self.owner, "status": {**(self.owner.get("status") or {}), **compute(self.owner)}}

    def log_tail(self, pod, namespace, container, lines=1):
        return self.log

    def states(self) -> dict[str, tuple[str, str]]:
        entries = ((self.owner or {}).get("status") or {}).get("adapters") or []
        return {e["name"]: (e["state"], e.get("message", "")) for e in entries}


@pytest.fixture
def pass_kube(monkeypatch, tmp_path):
    """PassKube's calls in place of the cluster's, the links under tmp_path, short retries; none left pending."""
    monkeypatch.setattr(adapters, "LINK_DIR", str(tmp_path / "links"))
    monkeypatch.setattr(adapter_sync, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(adapter_sync, "RETRY_MAX_S", 0.1)
    monkeypatch.setattr(adapter_sync, "_STOPPED", threading.Event())

    def install(fake: PassKube) -> PassKube:
        for call in ("list_pods", "read_service", "patch_status", "log_tail"):
            monkeypatch.setattr(kube, call, getattr(fake, call))
        monkeypatch.setattr(admin_tokens, "ensure", lambda owner: (ADMIN_TOKEN, False))  # the pod's token Secret
        return fake

    yield install
    adapter_sync.stop_retries()


def test_a_handlers_pass_runs_on_the_services_thread_and_calls_during_it_fold_into_one_more(monkeypatch) -> None:
    """A pass waits on pods (up to a minute per adapter on a slow one): the handler's call returns at once, calls
    while a pass runs ask for one more pass on the newest body, and a pass that fails does not stop the next."""
    monkeypatch.setattr(adapter_sync, "_STOPPED", threading.Event())
    release, passes = threading.Event(), []

    def slow_pass(owner) -> None:
        passes.append((owner["metadata"]["uid"], owner["spec"]["n"], threading.current_thread().name))
        if len(passes) == 1:
            assert release.wait(10)
            raise kopf.TemporaryError("the API answered 503")

    monkeypatch.setattr(adapter_sync, "sync_service", slow_pass)

    def body(uid: str, n: int) -> dict:
        return {"metadata": {"uid": uid, "name": f"svc-{uid}", "namespace": "ns"}, "spec": {"n": n}}

    started = time.monotonic()
    adapter_sync.sync_service_soon(body("a", 1))
    wait_for(lambda: passes, timeout=5, what="the first pass")
    for n in (2, 3, 4):  # while it waits on its pods
        adapter_sync.sync_service_soon(body("a", n))
    adapter_sync.sync_service_soon(body("b", 1))  # another service does not wait for this one's
    assert time.monotonic() - started < 2
    wait_for(lambda: ("b", 1, "adapters ns/svc-b") in passes, timeout=5, what="service b's pass")
    release.set()
    wait_for(lambda: len(passes) == 3 and not adapter_sync._WORKERS, timeout=5, what="the folded pass")
    assert [p for p in passes if p[0] == "a"] == [("a", 1, "adapters ns/svc-a"), ("a", 4, "adapters ns/svc-a")]
    adapter_sync.stop_retries()  # the operator stopping: no new pass
    adapter_sync.sync_service_soon(body("a", 5))
    time.sleep(0.2)
    assert len(passes) == 3 and not adapter_sync._WORKERS


def test_an_adapter_fetched_after_the_pass_is_loaded_by_a_retried_pass_without_a_resync(lora_pod, pass_kube) -> None:
    sql = {**SQL, "uri": "hf://acme/sql-lora@retry"}
    path = adapters.paths({"adapters": [sql]})["sql"]
    # the adapters container links it while the fourth pass runs: the three before find no link
    fake = pass_kube(PassKube(lora_pod, [sql], on_pass=lambda n: n == 4 and fetched(lora_pod, path)))
    adapter_sync.sync_service(fake.owner)  # the reconcile's pass
    state, message = fake.states()["sql"]
    assert state == adapter_sync.NOT_LOADED and ADAPTER_NOT_FOUND in message
    wait_for(lambda: fake.states()["sql"][0] == adapter_sync.LOADED, timeout=10, what="sql loaded by a retry")
    assert fake.delays == [None, 0.05, 0.1, 0.1]  # backoff: doubled, capped
    assert adapter_sync.served_adapters(lora_pod["admin"], ADMIN_TOKEN)["sql"] == path
    time.sleep(0.3)  # loaded: no retry after it
    assert len(fake.delays) == 4 and not adapter_sync._RETRIES


def test_a_refused_adapter_or_a_failed_fetch_is_not_retried_and_a_retry_goes_with_its_adapter_or_service(
    lora_pod, pass_kube, tmp_path, monkeypatch
) -> None:
    uid = OWNER["metadata"]["uid"]
    big = tmp_path / "rank8"  # the pod's engine runs with --max-lora-rank 4
    shutil.copytree(lora_pod["adapter"], big)
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    large = {"name": "large", "uri": "hf://acme/large-lora"}
    Path(adapters.paths({"adapters": [large]})["large"]).parent.mkdir(parents=True)
    Path(adapters.paths({"adapters": [large]})["large"]).symlink_to(big, target_is_directory=True)
    fake = pass_kube(PassKube(lora_pod, [large, GONE]))
    fake.log = "adapter gone: error: hf://acme/missing-lora: 404 Repository Not Found\n"
    adapter_sync.sync_service(fake.owner)
    states = fake.states()
    assert "has rank 8, above max_lora_rank 4" in states["large"][1]
    assert "; fetch: error: hf://acme/missing-lora" in states["gone"][1]
    time.sleep(0.3)
    assert len(fake.delays) == 1 and not adapter_sync._RETRIES  # both left to the resync

    # a pending retry goes when its adapter leaves the list (the reconcile's pass), the service is deleted, or the
    # operator stops
    monkeypatch.setattr(adapter_sync, "RETRY_FIRST_S", 30.0)
    fake.owner["spec"]["adapters"] = [CHAT]  # its link never comes
    adapter_sync.sync_service(fake.owner)
    timer = adapter_sync._RETRIES[uid]
    fake.owner["spec"]["adapters"] = []
    adapter_sync.sync_service(fake.owner)
    assert timer.finished.is_set() and uid not in adapter_sync._RETRIES
    fake.owner["spec"]["adapters"] = [CHAT]
    adapter_sync.sync_service(fake.owner)
    adapter_sync.forget(uid)  # announce_deletion
    assert uid not in adapter_sync._RETRIES
    adapter_sync.sync_service(fake.owner)
    adapter_sync.stop_retries()  # the operator's cleanup
    assert not adapter_sync._RETRIES
    adapter_sync.sync_service(fake.owner)
    assert not adapter_sync._RETRIES  # none planned after it

    # an adapter whose link never comes is retried for RETRY_FOR_S, then left to the resync; a newly listed one
    # gets short retries again
    monkeypatch.setattr(adapter_sync, "_STOPPED", threading.Event())
    monkeypatch.setattr(adapter_sync, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(adapter_sync, "RETRY_FOR_S", 0.2)
    adapter_sync.sync_service(fake.owner)
    time.sleep(0.5)  # past RETRY_FOR_S and a last retry
    wait_for(lambda: uid not in adapter_sync._RETRIES and not adapter_sync._PASSES[uid].locked(), timeout=5,
             what="the retries of chat given up")  # fmt: skip
    passes = len(fake.delays)
    adapter_sync.sync_service(fake.owner)  # the resync's pass: chat still waits
    assert uid not in adapter_sync._RETRIES and len(fake.delays) == passes + 1
    fake.owner["spec"]["adapters"] = [CHAT, MATH]
    adapter_sync.sync_service(fake.owner)
    assert adapter_sync._WAITS[uid][:2] == ({"chat", "math"}, 0.05) and uid in adapter_sync._RETRIES

    # a retry that finds the service deleted drops it
    adapter_sync.sync_service(fake.owner)
    passes, fake.owner = len(fake.delays), None
    time.sleep(0.3)
    assert len(fake.delays) == passes and not adapter_sync._RETRIES and not adapter_sync._WAITS


def _ready_pod(cluster, name: str) -> None:
    """A ready pod of the service at loopback, where `lora_pod` answers (the emulator runs no kubelet)."""
    labels = {"app.kubernetes.io/name": "overlap", "app.kubernetes.io/managed-by": "overlap-operator",
              "overlap.dev/inferenceservice": name}  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{name}-0", "labels": labels},
           "spec": {"containers": [{"name": "sidecar", "image": "overlap"}]}}  # fmt: skip
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    ready = {"podIP": "127.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    cluster.core.patch_namespaced_pod_status(f"{name}-0", NAMESPACE, {"status": ready})


def _states(cluster, name: str) -> dict[str, str]:
    service = cluster.get("inferenceservice", name) or {}
    return {e["name"]: e["state"] for e in (service.get("status") or {}).get("adapters") or []}


def _failed_fetch_log(folder: Path) -> str:
    """What `overlap model fetch-adapters` logs for GONE, whose repository the hub does not have."""
    listed = folder / "adapters.json"
    listed.write_text(json.dumps({GONE["name"]: GONE["uri"]}))
    hub = HubServer({}).start()
    try:
        command = overlap_cmd("model", "fetch-adapters", str(listed), "--cache-dir", str(folder / "cache"),
                              "--link-dir", str(folder / "links"))  # fmt: skip
        env = {**os.environ, "HF_ENDPOINT": hub.url}
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60).stderr
    finally:
        hub.stop()


def test_a_list_change_loads_and_unloads_adapters_in_the_running_pod_without_rolling_it(
    cluster, operator_process, lora_pod, tmp_path
) -> None:
    """The operator (another process) loads from the pod's links folder, so the links are made there, under names
    of this run's own (a uri's revision), and removed after."""
    if not os.access(Path(adapters.LINK_DIR).parent, os.W_OK):
        pytest.skip(f"the operator loads adapters from {adapters.LINK_DIR}, which this user cannot create")
    run = secrets.token_hex(4)
    sql, chat, math = ({**a, "uri": f"hf://acme/{a['name']}-lora@{run}"} for a in (SQL, CHAT, MATH))
    name = "lora"
    admin_port = int(lora_pod["admin"].rsplit(":", 1)[1])
    spec = {"model": {"servedName": "llm", "path": "/models/llm"}, "resources": {"gpus": 0},
            "sidecar": {"port": lora_pod["port"], "adminPort": admin_port}, "adapters": [sql, chat, GONE]}  # fmt: skip
    manifest = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}}
    links = list(adapters.paths({"adapters": [sql, chat, math]}).values())
    made_dir = not Path(adapters.LINK_DIR).exists()
    for path in links:
        fetched(lora_pod, path)
    # the pod's adapters container's log, as kubelet would serve it: the real fetch of the adapter that cannot be
    log = _failed_fetch_log(tmp_path)
    cluster.api.pod_logs = lambda pod, container: log if container == "adapters" else ""
    cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
    try:
        deployment = wait_for(lambda: cluster.get("deployment", name), timeout=20, what="the Deployment")
        assert "--enable-lora" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        # Play the kubelet: the pod mounts its key of the namespace's admin token Secret, which the sidecar follows.
        tokens = wait_for(lambda: cluster.core.read_namespaced_secret("overlap-admin-tokens", NAMESPACE), 20, "tokens")
        token = base64.b64decode(tokens.data[name]).decode()
        lora_pod["token_file"].write_text(token)
        _ready_pod(cluster, name)
        wait_for(lambda: _states(cluster, name) == {"sql": "Loaded", "chat": "Loaded", "gone": "NotLoaded"},
                 timeout=20, what="two adapters loaded into the pod, the third not")  # fmt: skip
        assert set(adapter_sync.served_adapters(lora_pod["admin"], token)) == {"sql", "chat"}
        (gone,) = [e for e in cluster.get("inferenceservice", name)["status"]["adapters"] if e["name"] == "gone"]
        assert gone["message"].startswith(
            "400: adapter 'gone': no adapter_config.json in '/var/run/overlap-adapters/gone-"
        )
        assert "; fetch: error: hf://acme/missing-lora" in gone["message"] and "404" in gone["message"], gone

        spec["adapters"] = [sql, math]  # chat out, math in
        cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
        wait_for(lambda: _states(cluster, name) == {"sql": "Loaded", "math": "Loaded"}, timeout=20,
                 what="math loaded and chat gone")  # fmt: skip
        assert set(adapter_sync.served_adapters(lora_pod["admin"], token)) == {"sql", "math"}  # chat unloaded
        listed = json.loads(cluster.get("configmap", f"{name}-adapters")["data"]["adapters.json"])
        assert listed == {"sql": sql["uri"], "math": math["uri"]}
        after = cluster.get("deployment", name)
        assert after["metadata"]["generation"] == deployment["metadata"]["generation"]  # not rolled
        assert after["spec"]["template"] == deployment["spec"]["template"]

        del spec["adapters"]  # none left: the list's ConfigMap and the status entries go, the pods lose --enable-lora
        cluster.apply("-f", "-", stdin=yaml.safe_dump({**manifest, "spec": spec}))
        wait_for(lambda: cluster.get("configmap", f"{name}-adapters") is None and not _states(cluster, name),
                 timeout=20, what="the adapter list and status gone")  # fmt: skip
        args = cluster.get("deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--enable-lora" not in args
        assert not not_granted(operator_requests(cluster), chart_grants())
    finally:
        lora_pod["token_file"].write_text(ADMIN_TOKEN)
        for path in links:
            Path(path).unlink(missing_ok=True)
        if made_dir:
            with contextlib.suppress(OSError):  # another run's links still there
                Path(adapters.LINK_DIR).rmdir()
        cluster.api.pod_logs = None
        cluster.kubectl("delete", "inferenceservice", name, "-n", NAMESPACE, "--ignore-not-found")
        cluster.kubectl("delete", "pod", f"{name}-0", "-n", NAMESPACE, "--ignore-not-found")
