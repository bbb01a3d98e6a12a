"""`overlap operator` (the real kopf operator, as a subprocess) against the emulated API, driven by the real kubectl.

The harness plays two controllers a real cluster runs: the Deployment controller (`play_deployment_controller`
sets readyReplicas) and the garbage collector (tests/support/kube deletes what an owner reference points at).
"""

from __future__ import annotations

import json
import time

import kubernetes_validate
import pytest
import yaml

from overlap.engine.config import LiveKnobs
from overlap.operator import identity
from tests.operator.conftest import API_TIMEOUT_S
from tests.support.cluster import (
    NAMESPACE,
    OPERATOR_TOKEN,
    REPO,
    chart_grants,
    not_granted,
    operator_requests,
    unused_grants,
    wait_for,
)

# The whole module is in the reliability suite: its RBAC row checks the API calls of every test before it.
pytestmark = pytest.mark.reliability

EXAMPLE = REPO / "examples" / "inferenceservice.yaml"
NAME = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
SERVED = yaml.safe_load(EXAMPLE.read_text())["spec"]["model"]["servedName"]
CHILDREN = [("deployment", NAME), ("service", NAME), ("configmap", f"{NAME}-engine"), ("pdb", NAME)]


@pytest.fixture(scope="module")
def applied(cluster, operator_process):
    """The example applied with kubectl; its children exist. Returns how long after the InferenceService was
    stored the last of them was (times taken by the API server, not by the test's polling)."""
    cluster.apply("-f", str(EXAMPLE))
    wait_for(lambda: all(cluster.get(kind, name) for kind, name in CHILDREN), timeout=10, what="the children")
    added = cluster.api.added_at
    kinds = {"deployment": "Deployment", "service": "Service", "configmap": "ConfigMap", "pdb": "PodDisruptionBudget"}
    stored = added[("InferenceService", NAMESPACE, NAME)]
    yield max(added[(kinds[kind], NAMESPACE, name)] for kind, name in CHILDREN) - stored


def configmap_engine(cluster) -> dict:
    return json.loads(cluster.get("configmap", f"{NAME}-engine")["data"]["engine.json"])


def condition(service: dict, kind: str) -> dict:
    return next(c for c in service.get("status", {}).get("conditions", []) if c["type"] == kind)


def test_apply_creates_the_children_with_owner_references_within_2s(cluster, applied) -> None:
    print(f"children created {applied:.3f} s after the InferenceService was stored")  # shown with pytest -s
    assert applied < 2.0, f"children appeared after {applied:.2f} s"
    uid = cluster.service(NAME)["metadata"]["uid"]
    for kind, name in CHILDREN:
        obj = cluster.get(kind, name)
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceService", NAME, uid, True)
    tokens = cluster.get("secret", "overlap-admin-tokens")
    assert [(r["name"], r["uid"], r["controller"]) for r in tokens["metadata"]["ownerReferences"]] == [
        (NAME, uid, False)
    ]
    assert list(tokens["data"]) == [NAME]


def test_children_as_stored_pass_strict_schema_validation(cluster, applied) -> None:
    version = kubernetes_validate.latest_version()
    for kind, name in [*CHILDREN, ("secret", "overlap-admin-tokens")]:
        obj = cluster.get(kind, name)
        for server_field in ("uid", "resourceVersion", "generation", "creationTimestamp"):
            assert server_field in obj["metadata"] or server_field == "generation"
        kubernetes_validate.validate(obj, version, strict=True)


def test_service_never_exposes_the_admin_port(cluster, applied) -> None:
    ports = cluster.get("service", NAME)["spec"]["ports"]
    assert [p["port"] for p in ports] == [8000]


def test_status_follows_api_conventions(cluster, applied) -> None:
    wait_for(lambda: cluster.service(NAME).get("status", {}).get("conditions"), what="status conditions")
    cluster.play_deployment_controller(NAME)
    service = wait_for(
        lambda: (s := cluster.service(NAME)) and condition(s, "Ready")["status"] == "True" and s,
        what="Ready=True after the pods are ready",
    )
    st = service["status"]
    assert st["observedGeneration"] == service["metadata"]["generation"]
    assert st["readyReplicas"] == 1 and st["replicas"] == 1
    assert st["selector"] == "app.kubernetes.io/name=overlap,overlap.dev/inferenceservice=" + NAME
    assert st["url"] == f"http://{NAME}.{NAMESPACE}.svc:8000"
    assert st["liveKnobs"] == LiveKnobs.of(configmap_engine(cluster)).to_camel()
    for cond in st["conditions"]:
        assert set(cond) >= {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    assert condition(service, "Degraded")["status"] == "False"
    assert condition(service, "Progressing")["reason"] == "RolloutComplete"


def test_kubectl_get_shows_the_printer_columns(cluster, applied) -> None:
    cluster.play_deployment_controller(NAME)
    wait_for(lambda: condition(cluster.service(NAME), "Ready")["status"] == "True", what="Ready")
    out = cluster.kubectl("get", "oisvc").stdout.splitlines()
    header, row = out[0].split(), out[1].split()
    assert header == ["NAME", "READY", "REPLICAS", "AVAILABLE", "MODEL", "URL", "AGE"]
    assert row[:6] == [NAME, "True", "1", "1", SERVED, f"http://{NAME}.{NAMESPACE}.svc:8000"]


def test_kubectl_scale_changes_the_deployment(cluster, applied) -> None:
    cluster.kubectl("scale", f"oisvc/{NAME}", "--replicas=3")
    wait_for(lambda: cluster.get("deployment", NAME)["spec"]["replicas"] == 3, what="Deployment at 3 replicas")
    cluster.play_deployment_controller(NAME, ready=2)
    service = wait_for(lambda: (s := cluster.service(NAME)) and s["status"].get("readyReplicas") == 2 and s)
    assert condition(service, "Progressing")["status"] == "True"
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/overlap.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceservices/{NAME}/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["selector"].endswith(NAME)
    cluster.kubectl("scale", f"oisvc/{NAME}", "--replicas=1")
    wait_for(lambda: cluster.get("deployment", NAME)["spec"]["replicas"] == 1, what="back to 1 replica")


def test_live_knob_edit_changes_the_configmap_not_the_pod_template(cluster, applied) -> None:
    template_before = cluster.get("deployment", NAME)["spec"]["template"]
    cluster.kubectl("patch", "oisvc", NAME, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":48}}}')
    wait_for(lambda: configmap_engine(cluster)["max_num_seqs"] == 48, what="the ConfigMap to follow")
    time.sleep(0.5)  # give a wrong rollout the chance to show up
    assert cluster.get("deployment", NAME)["spec"]["template"] == template_before
    wait_for(lambda: cluster.service(NAME)["status"]["liveKnobs"]["maxNumSeqs"] == 48, what="status.liveKnobs")


def test_restart_knob_edit_rolls_the_pods(cluster, applied) -> None:
    annotation = "overlap.dev/engine-restart-hash"
    before = cluster.get("deployment", NAME)["spec"]["template"]["metadata"]["annotations"][annotation]
    cluster.kubectl("patch", "oisvc", NAME, "--type=merge", "-p", '{"spec":{"engine":{"maxSeqLen":1024}}}')
    wait_for(
        lambda: cluster.get("deployment", NAME)["spec"]["template"]["metadata"]["annotations"][annotation] != before,
        what="a new pod template hash",
    )
    assert configmap_engine(cluster)["max_seq_len"] == 1024


def test_a_child_deleted_by_hand_is_put_back(cluster, applied) -> None:
    old_uid = cluster.get("service", NAME)["metadata"]["uid"]
    cluster.kubectl("delete", "service", NAME)
    restored = wait_for(
        lambda: (s := cluster.get("service", NAME)) and s["metadata"]["uid"] != old_uid and s, what="the Service back"
    )
    assert [p["port"] for p in restored["spec"]["ports"]] == [8000]


def test_a_child_deleted_in_a_watch_gap_is_put_back_by_the_resync(cluster, applied) -> None:
    """A deletion the operator's watch never reports (the history compacted while the watch was down): no event
    handler runs, and the periodic resync puts the child back."""
    old_uid = cluster.get("pdb", NAME)["metadata"]["uid"]
    cluster.api.lose_next_event("DELETED", "poddisruptionbudgets")
    cluster.kubectl("delete", "pdb", NAME)
    restored = wait_for(
        lambda: (p := cluster.get("pdb", NAME)) and p["metadata"]["uid"] != old_uid and p, timeout=30,
        what="the PDB back from the resync",
    )  # fmt: skip
    assert restored["spec"]["maxUnavailable"] == 1


def test_a_deleted_admin_token_secret_is_made_anew_before_a_new_pod_needs_it(cluster, applied) -> None:
    """Rotation: delete the Secret; the next pod of the service (here one the test creates, as the ReplicaSet
    would) finds a new token, and the owner reference ties it to the service."""
    secret = "overlap-admin-tokens"
    old = cluster.core.read_namespaced_secret(secret, NAMESPACE).data[NAME]
    cluster.kubectl("delete", "secret", secret)
    labels = {**identity.labels(NAME)}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{NAME}-rotation", "labels": labels},
           "spec": {"containers": [{"name": "sidecar", "image": "overlap"}]}}  # fmt: skip
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    try:
        new = wait_for(lambda: cluster.core.read_namespaced_secret(secret, NAMESPACE), what="the Secret made anew")
        assert new.data[NAME] != old and new.metadata.owner_references[0].name == NAME
    finally:
        cluster.core.delete_namespaced_pod(f"{NAME}-rotation", NAMESPACE)


def test_the_services_of_a_namespace_share_one_token_secret_with_a_key_each(cluster, applied) -> None:
    cluster.apply("-f", "-", stdin=EXAMPLE.read_text().replace(f"name: {NAME}", "name: second", 1))
    tokens = lambda: cluster.core.read_namespaced_secret("overlap-admin-tokens", NAMESPACE)  # noqa: E731
    wait_for(lambda: set(tokens().data) == {NAME, "second"}, what="a key for the second service")
    assert tokens().data[NAME] != tokens().data["second"]
    assert {r.name for r in tokens().metadata.owner_references} == {NAME, "second"}
    mounted = cluster.get("deployment", "second")["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in mounted if v["name"] == "admin-token"]
    assert volume["secret"]["items"] == [{"key": "second", "path": "admin-token"}]  # its own token only
    cluster.kubectl("delete", "oisvc", "second")
    # The garbage collector keeps a Secret another owner still holds, and drops the gone owner's reference.
    wait_for(lambda: [r.name for r in tokens().metadata.owner_references] == [NAME], what="one owner left")


def test_a_child_edited_by_hand_is_put_back(cluster, applied) -> None:
    expected = cluster.service(NAME)["spec"]["engine"]["maxNumSeqs"]
    cluster.kubectl("patch", "configmap", f"{NAME}-engine", "--type=merge", "-p", '{"data":{"engine.json":"{}"}}')
    wait_for(lambda: configmap_engine(cluster).get("max_num_seqs") == expected, what="the ConfigMap restored")
    cluster.kubectl("patch", "pdb", NAME, "--type=merge", "-p", '{"spec":{"maxUnavailable":0}}')
    wait_for(lambda: cluster.get("pdb", NAME)["spec"]["maxUnavailable"] == 1, what="the PDB restored")
    # Someone exposes the admin port by hand: the operator takes it off again.
    admin = '{"spec":{"ports":[{"name":"http","port":8000,"targetPort":"http"},{"name":"admin","port":8001}]}}'
    cluster.kubectl("patch", "service", NAME, "--type=merge", "-p", admin)
    wait_for(lambda: [p["port"] for p in cluster.get("service", NAME)["spec"]["ports"]] == [8000], what="8001 gone")


def test_events_record_what_the_operator_did(cluster, applied) -> None:
    events = json.loads(cluster.kubectl("get", "events", "-o", "json").stdout)["items"]
    ours = [e for e in events if e["involvedObject"].get("name") == NAME]
    messages = [e["message"] for e in ours]
    assert any(m.startswith("Deployment") and "created" in m for m in messages), messages
    # only what the operator posts itself: no log line of its handlers posted as an Event (kopf's reason "Logging")
    assert not [e for e in ours if e["reason"] == "Logging"], messages


TRANSIENT = {  # what the API server does to the Deployment write, what the operator's log says of it
    "409": ("a 409 Conflict", "409"),
    "500": ("a 500 Internal Server Error", "500"),
    "503": ("two 503s", "503"),
    "timeout": (f"a request held past the operator's {API_TIMEOUT_S} s API timeout", "timed out"),
}


@pytest.mark.parametrize("fault", list(TRANSIENT))
def test_transient_api_errors_are_retried(cluster, operator_process, applied, reliability, fault) -> None:
    name = f"retried-{fault}"  # the fault hits its Deployment's write, not a write another reconcile makes first
    if fault == "timeout":
        cluster.api.hang_next("PATCH", "deployments", seconds=API_TIMEOUT_S + 3, name=name)
    else:
        cluster.api.fail_next("PATCH", "deployments", status=int(fault), times=2 if fault == "503" else 1, name=name)
    cluster.apply("-f", "-", stdin=EXAMPLE.read_text().replace(f"name: {NAME}", f"name: {name}", 1))
    wait_for(lambda: cluster.get("deployment", name), timeout=30, what=f"the Deployment after {TRANSIENT[fault][0]}")
    retried = [line for line in operator_process.log().splitlines() if name in line and "retrying" in line]
    assert retried and TRANSIENT[fault][1] in retried[0], retried
    wait_for(lambda: cluster.service(name)["status"].get("observedGeneration") == 1, timeout=30, what="its status")
    cluster.kubectl("delete", "oisvc", name)
    reliability.row(
        "Operator", f"{TRANSIENT[fault][0]} from the API server on the Deployment write",
        load="one new InferenceService", outcome="retried with back-off (the log says so); the Deployment created "
        "and the status written",
    )  # fmt: skip


def test_watches_cut_by_the_api_server_resume_and_an_expired_history_relists(
    cluster, operator_process, applied, reliability
) -> None:
    """An API server restart (or a proxy's idle timeout) cuts every watch, and etcd has compacted the history they
    would resume from: the operator is told 410 Expired, lists again and keeps reconciling."""

    def count(watch: bool) -> int:  # watch requests, or lists (a collection read that does not watch)
        reads = [r for r in list(cluster.api.request_log) if str(r.method.value).upper() == "GET" and r.name is None]
        return sum(1 for r in reads if r.resource is not None and (r.params.get("watch") == "true") == watch)

    watches, lists = count(watch=True), count(watch=False)
    cluster.api.compact()
    cut = cluster.end_watches()
    assert cut >= 1
    wait_for(lambda: count(watch=True) >= watches + cut, timeout=15, what="the watches resumed")
    wait_for(lambda: count(watch=False) > lists, timeout=15, what="a list again after 410 Expired")
    cluster.kubectl("scale", f"oisvc/{NAME}", "--replicas=2")
    wait_for(lambda: cluster.get("deployment", NAME)["spec"]["replicas"] == 2, timeout=15, what="the scale followed")
    cluster.kubectl("patch", "pdb", NAME, "--type=merge", "-p", '{"spec":{"maxUnavailable":0}}')
    wait_for(lambda: cluster.get("pdb", NAME)["spec"]["maxUnavailable"] == 1, timeout=15, what="the PDB restored")
    cluster.kubectl("scale", f"oisvc/{NAME}", "--replicas=1")
    wait_for(lambda: cluster.get("deployment", NAME)["spec"]["replicas"] == 1, timeout=15, what="back to 1 replica")
    reliability.row(
        "Operator", f"every watch cut by the API server ({cut} streams), its history compacted (410 Expired)",
        load="one InferenceService, then a scale and a child edited by hand",
        outcome="the watches opened again (listing anew); the scale followed and the edited PDB was put back",
    )  # fmt: skip


def test_a_refused_apply_sets_degraded_with_the_servers_words_and_backs_off_until_it_passes(
    cluster, operator_process, applied
) -> None:
    """403 (RBAC not there yet) is retried, not given up on; meanwhile Degraded says what the API server said."""
    cluster.api.fail_next("PATCH", "deployments", status=403, times=2, name="forbidden")
    manifest = EXAMPLE.read_text().replace(f"name: {NAME}", "name: forbidden", 1)
    cluster.apply("-f", "-", stdin=manifest)
    degraded = wait_for(
        lambda: (s := cluster.service("forbidden")).get("status") and condition(s, "Degraded")["status"] == "True"
        and condition(s, "Degraded"), timeout=10, what="Degraded on the refused apply",
    )  # fmt: skip
    assert degraded["reason"] == "ApplyFailed" and "Deployment forbidden not applied" in degraded["message"]
    assert "403" in degraded["message"]
    wait_for(lambda: cluster.get("deployment", "forbidden"), timeout=20, what="the Deployment after two 403s")
    wait_for(lambda: condition(cluster.service("forbidden"), "Degraded")["status"] == "False", 10, "Degraded cleared")
    log = operator_process.log()
    assert "retrying in 2 s" in log and "retrying in 4 s" in log  # backed off
    cluster.kubectl("delete", "oisvc", "forbidden")


def test_invalid_spec_that_slipped_past_the_schema_sets_degraded(cluster, operator_process, applied) -> None:
    # A server without CEL (or an older CRD) would store this; the operator must not act on it.
    manifest = EXAMPLE.read_text().replace(f"name: {NAME}", "name: slipped", 1)
    manifest += "  autoscaling: {minReplicas: 5, maxReplicas: 2}\n"
    cluster.api.validate_custom_resources = False
    try:
        cluster.apply("-f", "-", stdin=manifest)
    finally:
        cluster.api.validate_custom_resources = True
    service = wait_for(
        lambda: (s := cluster.service("slipped")) and s.get("status", {}).get("conditions") and s, what="Degraded"
    )
    degraded = condition(service, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "autoscaling.minReplicas must be <= autoscaling.maxReplicas" in degraded["message"]
    assert cluster.get("deployment", "slipped") is None
    # Fixing the spec clears Degraded and creates what was missing.
    cluster.kubectl("patch", "oisvc", "slipped", "--type=merge", "-p", '{"spec":{"autoscaling":{"maxReplicas":6}}}')
    wait_for(lambda: cluster.get("deployment", "slipped"), what="the Deployment once the spec is fixed")
    wait_for(lambda: condition(cluster.service("slipped"), "Degraded")["status"] == "False", what="Degraded=False")
    cluster.kubectl("delete", "oisvc", "slipped")


def test_servicemonitor_when_prometheus_operator_is_installed(cluster, applied) -> None:
    schema = {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": schema}],
        },
    }
    cluster.apply("-f", "-", stdin=json.dumps(crd))
    cluster.kubectl("annotate", "oisvc", NAME, "example.com/touch=1", "--overwrite")
    monitor = wait_for(lambda: cluster.get("servicemonitor", NAME), what="the ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "http"


def test_disabling_the_servicemonitor_deletes_it(cluster, applied) -> None:
    assert cluster.get("servicemonitor", NAME), "runs after the test that installs the ServiceMonitor CRD"
    patch = {"spec": {"prometheus": {"serviceMonitor": {"enabled": False}}}}
    cluster.kubectl("patch", "oisvc", NAME, "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: cluster.get("servicemonitor", NAME) is None, what="the ServiceMonitor deleted")
    events = json.loads(cluster.kubectl("get", "events", "-o", "json").stdout)["items"]
    assert any(e["reason"] == "Deleted" and e["message"].startswith("ServiceMonitor") for e in events)


def test_fields_removed_from_the_spec_leave_the_deployment(cluster, applied) -> None:
    """Server-side apply: what the operator stops setting goes; what someone else set on the Deployment stays."""
    placement = {"nodeSelector": {"gpu": "h200"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                 "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                     "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In",
                                                                  "values": ["a"]}]}]}}}}  # fmt: skip
    patch = {"spec": {"resources": placement, "images": {"pullSecrets": ["registry"]}}}
    cluster.kubectl("patch", "oisvc", NAME, "--type", "merge", "-p", json.dumps(patch))
    pod = lambda: cluster.get("deployment", NAME)["spec"]["template"]["spec"]  # noqa: E731
    wait_for(lambda: "affinity" in pod() and pod().get("imagePullSecrets"), what="the placement on the pods")
    cluster.kubectl("annotate", "deployment", NAME, "example.com/owner=someone-else")
    removed = {"spec": {"resources": {key: None for key in placement}, "images": {"pullSecrets": None}}}
    cluster.kubectl("patch", "oisvc", NAME, "--type", "merge", "-p", json.dumps(removed))
    gone = ("nodeSelector", "tolerations", "affinity", "imagePullSecrets")
    wait_for(lambda: not any(key in pod() for key in gone), what=f"{gone} gone from the pod template")
    assert cluster.get("deployment", NAME)["metadata"]["annotations"]["example.com/owner"] == "someone-else"
    shown = cluster.kubectl("get", "deployment", NAME, "-o", "json", "--show-managed-fields").stdout
    assert "overlap-operator" in {m["manager"] for m in json.loads(shown)["metadata"]["managedFields"]}


def test_no_finalizer_without_a_control_loop_and_one_once_it_is_on(cluster, applied) -> None:
    """kopf's finalizer guards the control loop's timer only: a service without autoscaling or tuning has none, so
    it is deleted even when no operator runs."""
    time.sleep(1.5)  # the operator has handled the create (children exist) and had time to add one if it would
    assert "overlap.dev/finalizer" not in (cluster.service(NAME)["metadata"].get("finalizers") or [])
    cluster.kubectl(
        "patch", "inferenceservice", NAME, "--type", "merge", "-p", '{"spec": {"tuning": {"enabled": true}}}'
    )
    wait_for(lambda: "overlap.dev/finalizer" in (cluster.service(NAME)["metadata"].get("finalizers") or []), 10,
             what="the finalizer once tuning is on")  # fmt: skip
    cluster.kubectl(
        "patch", "inferenceservice", NAME, "--type", "merge", "-p", '{"spec": {"tuning": {"enabled": false}}}'
    )


def test_scaling_to_zero_adds_the_activator_routes_by_readiness_and_removes_it_after(cluster, applied) -> None:
    activator, pods = f"{NAME}-activator", f"{NAME}-pods"
    patch = {"spec": {"autoscaling": {"mode": "advise", "minReplicas": 0}}}
    cluster.kubectl("patch", "inferenceservice", NAME, "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: cluster.get("deployment", activator) and cluster.get("service", pods), 10, "the activator")
    assert cluster.get("service", pods)["spec"]["selector"] == identity.selector_labels(NAME)

    def routes_to(labels: dict) -> bool:
        return cluster.get("service", NAME)["spec"]["selector"] == labels

    cluster.play_deployment_controller(NAME, ready=0)  # no ready replica: the activator answers
    wait_for(lambda: routes_to(identity.activator_labels(NAME)), 10, "the Service to route to the activator")
    cluster.play_deployment_controller(NAME, ready=1)  # a ready pod takes the traffic back at once
    wait_for(lambda: routes_to(identity.selector_labels(NAME)), 10, "the Service to route to the pods")
    events = {e.reason for e in cluster.core.list_namespaced_event(NAMESPACE).items if e.involved_object.name == NAME}
    assert "Routed" in events
    patch = {"spec": {"autoscaling": {"mode": "off", "minReplicas": 1}}}
    cluster.kubectl("patch", "inferenceservice", NAME, "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: cluster.get("deployment", activator) is None and cluster.get("service", pods) is None, 10,
             "the activator to go")  # fmt: skip
    assert routes_to(identity.selector_labels(NAME))


def test_deleting_the_inferenceservice_removes_its_children(cluster, applied) -> None:
    cluster.kubectl("delete", "oisvc", NAME)
    wait_for(lambda: all(cluster.get(kind, name) is None for kind, name in CHILDREN), what="the children gone")
    assert cluster.get("secret", "overlap-admin-tokens") is None, "its last owner is gone"


def test_the_operator_needs_only_what_the_chart_grants(cluster, applied, reliability) -> None:
    granted = chart_grants()
    used = operator_requests(cluster)
    assert used, "no operator requests were recorded"
    assert not not_granted(used, granted), f"the chart does not grant: {sorted(not_granted(used, granted))}"
    # The only Secret the operator reads or writes is its own: secret requests by name name that one.
    assert {u[3] for u in used if u[2] == "secrets" and u[3]} == {"overlap-admin-tokens"}, sorted(used)
    # Least privilege: what is granted but was not needed in these tests must be explained here.
    unused = unused_grants(used, granted)
    expected_unused = {
        # setting blockOwnerDeletion needs it where OwnerReferencesPermissionEnforcement is on (not emulated)
        ("update", "overlap.dev", "inferenceservices/finalizers", None),
        # a fetching pod's progress line, read only while a model.uri is being fetched (no service here has one)
        ("get", "", "pods/log", None),
        # a service's adapter list, deleted once spec.adapters empties (test_adapters.py; no service here has one)
        ("delete", "", "configmaps", None),
    }
    assert unused <= expected_unused, f"granted but never used: {sorted(unused - expected_unused)}"
    reliability.row(
        "Security", "RBAC least privilege: every API call the operator made in its module's tests",
        load=f"{len(used)} distinct (verb, group, resource, name) calls recorded by the API emulator",
        outcome=f"each allowed by the chart's roles; of the {len(granted)} grants only {len(unused)} unused, "
        "explained in the test", whole_module=True,
    )  # fmt: skip


def test_the_operators_lists_and_watches_of_children_carry_a_label_selector(cluster, applied) -> None:
    """Server-side filtering: the API server sends the operator its own children only, not every object of
    those kinds in the cluster (the harness records each request's query)."""
    children = {"configmaps", "services", "deployments", "poddisruptionbudgets", "pods"}
    seen = set()
    for request in list(cluster.api.request_log):
        if request.headers.get("Authorization") != f"Bearer {OPERATOR_TOKEN}" or request.resource is None:
            continue
        if str(request.method.value).upper() != "GET" or request.name or request.resource.plural not in children:
            continue
        selector = request.params.get("labelSelector", "")
        assert "app.kubernetes.io/" in selector, f"unfiltered list/watch of {request.resource.plural}: {request.params}"
        seen.add(request.resource.plural)
    assert {"configmaps", "services", "deployments", "poddisruptionbudgets", "pods"} <= seen, seen
