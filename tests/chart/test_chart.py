"""The Helm chart: rendered with the real helm, every manifest strictly valid, the CRD a copy of crds/, values
documented and typed, RBAC limited to what the operator uses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

# The CRD admission of the operator tests (schema + CEL), to check rendered InferenceServices too.
from tests.support.kube import admission

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "overlap"
HELM = REPO / ".tools" / "bin" / "helm"
CRD_SOURCE = REPO / "crds" / "inferenceservices.overlap.dev.yaml"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
K8S_VERSION = kubernetes_validate.latest_version()


pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm is not in .tools/bin: run `make tools`")


def render(*args: str) -> list[dict]:
    cmd = [str(HELM), "template", "overlap", str(CHART), "--namespace", "overlap-system", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: v.name if v else "default")
def test_every_rendered_manifest_is_strictly_valid(values: Path | None) -> None:
    docs = render(*(["-f", str(values)] if values else []))
    assert by_kind(docs, "Deployment")
    crd = yaml.safe_load(CRD_SOURCE.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for doc in docs:
        if doc["kind"] == "InferenceService":
            admission.admit(doc, schema, strict=True)
        elif doc["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_chart_crd_is_an_exact_copy_of_crds() -> None:
    copies = sorted((CHART / "files" / "crds").glob("*.yaml"))
    sources = sorted((REPO / "crds").glob("*.yaml"))
    assert [p.name for p in copies] == [p.name for p in sources]
    for copy, source in zip(copies, sources, strict=True):
        assert copy.read_bytes() == source.read_bytes(), f"{copy} differs from {source}: run `make crd-sync`"


@pytest.mark.parametrize("keep", [True, False])
def test_rendered_crd_equals_the_source(keep: bool) -> None:
    (crd,) = by_kind(render("--set", f"crds.keep={str(keep).lower()}"), "CustomResourceDefinition")
    annotations = crd["metadata"].pop("annotations", {})
    assert annotations == ({"helm.sh/resource-policy": "keep"} if keep else {})
    assert crd == yaml.safe_load(CRD_SOURCE.read_text())


def test_crds_can_be_left_out() -> None:
    assert not by_kind(render("--set", "crds.enabled=false"), "CustomResourceDefinition")


def test_values_schema_refuses_unknown_keys() -> None:
    cmd = [str(HELM), "template", "overlap", str(CHART), "--set", "replicaCount=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "additional properties 'replicaCount' not allowed" in done.stderr


def test_global_values_are_allowed_so_the_chart_works_as_a_subchart() -> None:
    cmd = [str(HELM), "template", "overlap", str(CHART), "--set", "global.imageRegistry=registry.example"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_value_is_documented_and_typed() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load("\n".join(lines))
    for index, line in enumerate(lines):
        key = line.split(":")[0].strip()
        indent = len(line) - len(line.lstrip())
        if line.strip() and not line.lstrip().startswith(("#", "-")) and ":" in line and indent <= 2:
            above = index - 1
            while above >= 0 and lines[above].lstrip().startswith("#") and not lines[above].lstrip().startswith("# --"):
                above -= 1  # a comment may run over several lines; its first one starts with `# --`
            assert lines[above].lstrip().startswith("# --"), f"values.yaml: `{key}` has no `# --` comment"
    for key, value in values.items():
        assert key in schema["properties"], f"values.schema.json lacks {key}"
        if isinstance(value, dict) and schema["properties"][key].get("properties"):
            assert set(value) <= set(schema["properties"][key]["properties"]), key


def test_rbac_grants_only_what_the_operator_uses() -> None:
    (role,) = [r for r in by_kind(render(), "ClusterRole") if r["metadata"]["name"] == "overlap"]
    grants = {(group, resource, *rule.get("resourceNames", [])): set(rule["verbs"]) for rule in role["rules"]
              for group in rule["apiGroups"] for resource in rule["resources"]}  # fmt: skip
    assert grants == {
        ("overlap.dev", "inferenceservices"): {"get", "list", "watch", "patch"},
        ("overlap.dev", "inferenceservices/status"): {"patch"},
        ("overlap.dev", "inferenceservices/finalizers"): {"update"},
        # delete: the activator of a service that no longer scales to zero (its Deployment and Service)
        ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
        # delete: a service's adapter list (NAME-adapters) once spec.adapters lists none
        ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
        ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
        # No Secret can be read but the operator's own (create cannot be scoped by name).
        ("", "secrets"): {"create"},
        ("", "secrets", "overlap-admin-tokens"): {"get", "patch"},
        ("", "pods"): {"list", "watch"},
        ("", "pods/log"): {"get"},
        ("policy", "poddisruptionbudgets"): {"get", "list", "watch", "create", "patch"},
        ("monitoring.coreos.com", "servicemonitors"): {"get", "create", "patch", "delete"},
        ("", "events"): {"create"},
    }


def test_namespaced_install_uses_roles_and_namespace_flags() -> None:
    docs = render("-f", str(CHART / "ci" / "namespaced-values.yaml"))
    # The operator gets Roles only; the users' aggregated roles are ClusterRoles by nature (aggregation needs them).
    assert {r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")} == {"overlap-edit", "overlap-view"}
    assert not by_kind(docs, "ClusterRoleBinding")
    operator_roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "overlap"]
    assert sorted(r["metadata"]["namespace"] for r in operator_roles) == ["team-a", "team-b"]
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_operator_runs_one_replica_replaced_not_overlapped() -> None:
    (deployment,) = by_kind(render(), "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][1:3] == ["operator", "--standalone"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_prometheus_url_reaches_the_operator_only_when_set() -> None:
    def operator_args(*args: str) -> list[str]:
        (deployment,) = by_kind(render(*args), "Deployment")
        return deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not any(a.startswith("--prometheus-url") for a in operator_args())
    url = "--prometheus-url=http://prometheus-operated.monitoring:9090"
    assert url in operator_args("-f", str(CHART / "ci" / "example-values.yaml"))


def test_dashboard_configmap_carries_the_dashboard_json() -> None:
    assert not [d for d in by_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("-dashboards")]
    (configmap,) = [
        d
        for d in by_kind(render("--set", "dashboards.enabled=true"), "ConfigMap")
        if d["metadata"]["name"].endswith("-dashboards")
    ]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["overlap-inferenceservice.json"])
    assert dashboard == json.loads((CHART / "files" / "dashboards" / "overlap.json").read_text())
    assert all(panel["targets"] for panel in dashboard["panels"])


def test_the_chart_creates_no_inferenceservice_and_its_notes_give_one_that_applies() -> None:
    """A post-install hook could fail on a fresh API server ("no matches for kind": the CRD is a template of the same
    release) and outlived an uninstall with kopf's finalizer on it; NOTES prints the command instead."""
    assert not by_kind(render(), "InferenceService")
    test_pods = [d for d in render() if d["kind"] == "Pod"]
    assert test_pods and test_pods[0]["metadata"]["annotations"]["helm.sh/hook"] == "test"
    notes = subprocess.run([str(HELM), "install", "overlap", str(CHART), "--dry-run", "--namespace", "ml",
                            "--set", "watch.namespaces={ml}"], capture_output=True, text=True, timeout=60,
                           check=True).stdout  # fmt: skip
    manifest = notes[notes.index("apiVersion: overlap.dev/v1alpha1") : notes.index("  EOF")]
    service = yaml.safe_load("\n".join(line.removeprefix("  ") for line in manifest.splitlines()))
    assert "kubectl apply -n ml -f -" in notes
    crd = yaml.safe_load(CRD_SOURCE.read_text())
    stored = admission.admit(service, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], strict=True)
    assert stored["spec"]["model"]["path"] == "/models/tiny"  # what the engine image holds


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: v.name if v else "default")
def test_helm_lint_is_clean(values: Path | None) -> None:
    cmd = [str(HELM), "lint", "--strict", str(CHART), *(["-f", str(values)] if values else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout


def test_users_get_inferenceservices_through_the_built_in_roles() -> None:
    roles = {r["metadata"]["name"]: r for r in by_kind(render(), "ClusterRole")}
    edit, view = roles["overlap-edit"], roles["overlap-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete", "patch"} <= set(edit["rules"][0]["verbs"])
    assert set(view["rules"][0]["verbs"]) == {"get", "list", "watch"}
    assert "overlap-edit" not in {r["metadata"]["name"] for r in by_kind(render("--set", "rbac.userRoles=false"),
                                                                        "ClusterRole")}  # fmt: skip


def test_helm_test_runs_where_the_operator_looks_and_within_helms_default_timeout() -> None:
    docs = render("--set", "watch.namespaces={ml,search}")
    serve = [d for d in docs if d["metadata"]["name"].endswith("-test-serve")]
    role, binding = by_kind(serve, "Role")[0], by_kind(serve, "RoleBinding")[0]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ml"  # not the unwatched release's
    (pod,) = by_kind(serve, "Pod")
    command = pod["spec"]["containers"][0]["command"]
    assert command[2] == "ml" and float(command[command.index("--timeout-s") + 1]) < 300  # helm test's default
    watched = render("--set", "watch.namespaces={overlap-system}")
    (pod,) = [d for d in by_kind(watched, "Pod") if d["metadata"]["name"].endswith("-test-serve")]
    assert pod["spec"]["containers"][0]["command"][2] == "overlap-system"
