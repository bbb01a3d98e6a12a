"""The test API server behaves like a real one where the operator tests rely on it (the table in
tests/support/kube/server.py)."""

from __future__ import annotations

import json
import urllib.request

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from tests.support.cluster import NAMESPACE

SERVICE = {
    "apiVersion": "overlap.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "emu"},
    "spec": {"model": {"servedName": "emu", "path": "/models/emu"}},
}
CR = ("overlap.dev", "v1alpha1", NAMESPACE, "inferenceservices")


def configmap(name: str, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels or {}}, "data": {}}


def raw(cluster, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        cluster.url + path, method=method, data=json.dumps(body).encode() if body else None
    )
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, json.loads(response.read())


def test_create_answers_201_with_server_fields_and_lists_have_a_kind(cluster) -> None:
    status, created = raw(cluster, "POST", f"/api/v1/namespaces/{NAMESPACE}/configmaps/", configmap("emu-created"))
    assert status == 201
    meta = created["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"] and meta["namespace"] == NAMESPACE
    status, listed = raw(cluster, "GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/")
    assert listed["kind"] == "ConfigMapList" and int(listed["metadata"]["resourceVersion"]) >= int(
        meta["resourceVersion"]
    )
    status, namespaces = raw(cluster, "GET", "/api/v1/namespaces")
    assert NAMESPACE in [ns["metadata"]["name"] for ns in namespaces["items"]]


def test_label_selectors_filter_lists(cluster) -> None:
    cluster.core.create_namespaced_config_map(NAMESPACE, configmap("emu-a", {"tier": "a"}))
    cluster.core.create_namespaced_config_map(NAMESPACE, configmap("emu-b", {"tier": "b"}))
    names = lambda selector: sorted(  # noqa: E731
        i.metadata.name for i in cluster.core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items
    )
    assert names("tier=a") == ["emu-a"]
    assert names("tier in (a,b)") == ["emu-a", "emu-b"]
    assert names("tier!=a,tier") == ["emu-b"]


def test_generation_follows_the_spec_and_status_is_a_subresource(cluster) -> None:
    cluster.custom.create_namespaced_custom_object(*CR, SERVICE)
    first = cluster.custom.get_namespaced_custom_object(*CR, "emu")
    assert first["metadata"]["generation"] == 1 and first["spec"]["replicas"] == 1  # defaulted by the CRD schema
    patched = cluster.custom.patch_namespaced_custom_object(
        *CR, "emu", {"metadata": {"annotations": {"a": "b"}}, "status": {"url": "ignored"}}
    )
    assert patched["metadata"]["generation"] == 1 and "status" not in patched
    patched = cluster.custom.patch_namespaced_custom_object_status(
        *CR, "emu", {"spec": {"replicas": 5}, "status": {"url": "kept"}}
    )
    assert patched["status"] == {"url": "kept"} and patched["spec"]["replicas"] == 1
    assert patched["metadata"]["generation"] == 1
    patched = cluster.custom.patch_namespaced_custom_object(*CR, "emu", {"spec": {"replicas": 2}})
    assert patched["metadata"]["generation"] == 2
    assert int(patched["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])


def test_stale_writes_conflict_and_json_patch_tests_are_enforced(cluster) -> None:
    current = cluster.custom.get_namespaced_custom_object(*CR, "emu")
    stale = {"metadata": {"resourceVersion": "1"}, "status": {"url": "x"}}
    with pytest.raises(ApiException) as caught:
        cluster.custom.patch_namespaced_custom_object_status(*CR, "emu", stale)
    assert caught.value.status == 409
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
           {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}]  # fmt: skip
    with pytest.raises(ApiException) as caught:
        cluster.custom.patch_namespaced_custom_object(*CR, "emu", ops, _content_type="application/json-patch+json")
    assert caught.value.status == 422
    ops[0]["value"] = current["metadata"]["resourceVersion"]
    patched = cluster.custom.patch_namespaced_custom_object(
        *CR, "emu", ops, _content_type="application/json-patch+json"
    )
    assert patched["metadata"]["finalizers"] == ["x"]


def test_finalizers_hold_deletion_until_removed(cluster) -> None:
    cluster.custom.delete_namespaced_custom_object(*CR, "emu")
    held = cluster.custom.get_namespaced_custom_object(*CR, "emu")
    assert held["metadata"]["deletionTimestamp"]
    cluster.custom.patch_namespaced_custom_object(*CR, "emu", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as caught:
        cluster.custom.get_namespaced_custom_object(*CR, "emu")
    assert caught.value.status == 404


def test_watch_resumes_after_a_resource_version_and_honours_its_timeout(cluster) -> None:
    before = cluster.core.create_namespaced_config_map(NAMESPACE, configmap("emu-w1"))
    cluster.core.create_namespaced_config_map(NAMESPACE, configmap("emu-w2"))
    watch = kubernetes.watch.Watch()
    events = list(
        watch.stream(
            cluster.core.list_namespaced_config_map,
            NAMESPACE,
            resource_version=before.metadata.resource_version,
            timeout_seconds=1,
        )
    )
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "emu-w2")]


def test_scale_subresource_reads_and_writes_the_spec(cluster) -> None:
    cluster.custom.create_namespaced_custom_object(*CR, {**SERVICE, "metadata": {"name": "emu-scale"}})
    scale = cluster.custom.get_namespaced_custom_object_scale(*CR, "emu-scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    cluster.custom.patch_namespaced_custom_object_scale(*CR, "emu-scale", {"spec": {"replicas": 4}})
    assert cluster.custom.get_namespaced_custom_object(*CR, "emu-scale")["spec"]["replicas"] == 4


def test_the_garbage_collector_follows_owner_references(cluster) -> None:
    owner = cluster.custom.get_namespaced_custom_object(*CR, "emu-scale")
    ref = {"apiVersion": "overlap.dev/v1alpha1", "kind": "InferenceService", "name": "emu-scale",
           "uid": owner["metadata"]["uid"], "controller": True}  # fmt: skip
    child = configmap("emu-owned")
    child["metadata"]["ownerReferences"] = [ref]
    cluster.core.create_namespaced_config_map(NAMESPACE, child)
    cluster.custom.delete_namespaced_custom_object(*CR, "emu-scale")
    with pytest.raises(ApiException) as caught:
        cluster.core.read_namespaced_config_map("emu-owned", NAMESPACE)
    assert caught.value.status == 404
    # A child written after its owner is gone (a reconcile racing the deletion) is collected too.
    late = configmap("emu-late")
    late["metadata"]["ownerReferences"] = [ref]
    cluster.core.create_namespaced_config_map(NAMESPACE, late)
    with pytest.raises(ApiException) as caught:
        cluster.core.read_namespaced_config_map("emu-late", NAMESPACE)
    assert caught.value.status == 404


def deployment(name: str, **pod_spec) -> dict:
    labels = {"app": name}
    container = {"name": "main", "image": "busybox:1", "env": [{"name": "A", "value": "1"}]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [container], **pod_spec}}}}  # fmt: skip


def server_side_apply(cluster, obj: dict, *flags: str) -> dict:
    flags = ("--server-side", "--field-manager=owner", *flags, "-o", "json", "--show-managed-fields")
    done = cluster.apply(*flags, "-f", "-", stdin=json.dumps(obj))
    return json.loads(done.stdout)


def test_server_side_apply_records_managers_and_a_repeat_is_a_no_op(cluster) -> None:
    first = server_side_apply(cluster, deployment("emu-ssa"))
    managers = {(m["manager"], m["operation"]) for m in first["metadata"]["managedFields"]}
    assert managers == {("owner", "Apply")}
    fields = first["metadata"]["managedFields"][0]["fieldsV1"]
    containers = fields["f:spec"]["f:template"]["f:spec"]["f:containers"]
    assert set(containers) == {'k:{"name":"main"}'} and "f:image" in containers['k:{"name":"main"}']
    again = server_side_apply(cluster, deployment("emu-ssa"))
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


def test_a_field_the_manager_stops_applying_goes_and_what_others_set_stays(cluster) -> None:
    server_side_apply(cluster, deployment("emu-drop", nodeSelector={"gpu": "h200"}, tolerations=[{"key": "gpu"}]))
    cluster.kubectl("label", "deployment", "emu-drop", "team=ml")  # another manager: kubectl-label
    cluster.kubectl("set", "env", "deployment/emu-drop", "B=2")  # an env entry of someone else's
    after = server_side_apply(cluster, deployment("emu-drop"))
    pod = after["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert after["metadata"]["labels"] == {"team": "ml"}
    env = sorted(pod["containers"][0]["env"], key=lambda item: item["name"])
    assert env == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]


def test_an_apply_over_another_managers_value_conflicts_unless_forced(cluster) -> None:
    server_side_apply(cluster, deployment("emu-conflict"))
    cluster.kubectl("scale", "deployment", "emu-conflict", "--replicas=5")
    refused = cluster.apply("--server-side", "--field-manager=owner", "-f", "-",
                            stdin=json.dumps(deployment("emu-conflict")), check=False)  # fmt: skip
    assert refused.returncode != 0 and "conflict" in refused.stderr and ".spec.replicas" in refused.stderr
    forced = server_side_apply(cluster, deployment("emu-conflict"), "--force-conflicts")
    assert forced["spec"]["replicas"] == 2
    owners = {m["manager"]: m["fieldsV1"] for m in forced["metadata"]["managedFields"]}
    assert "f:replicas" in owners["owner"]["f:spec"]
    assert all("f:replicas" not in (f.get("f:spec") or {}) for m, f in owners.items() if m != "owner")


def test_apply_needs_a_field_manager_and_force_only_goes_with_apply(cluster) -> None:
    apps = kubernetes.client.AppsV1Api(cluster.client)
    with pytest.raises(ApiException) as missing:
        apps.patch_namespaced_deployment("emu-x", NAMESPACE, deployment("emu-x"),
                                         _content_type="application/apply-patch+yaml")  # fmt: skip
    assert missing.value.status == 422 and "fieldManager" in missing.value.body
    with pytest.raises(ApiException) as forced:
        apps.patch_namespaced_deployment("emu-x", NAMESPACE, {"spec": {}}, force=True,
                                         _content_type="application/merge-patch+json")  # fmt: skip
    assert forced.value.status == 422
