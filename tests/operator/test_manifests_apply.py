"""The chart's rendered manifests and every example apply with the real kubectl (`helm template | kubectl apply`;
`helm install` needs a real cluster)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.support.cluster import NAMESPACE, REPO, wait_for

HELM = REPO / ".tools" / "bin" / "helm"


def test_helm_template_applies(cluster) -> None:
    if not HELM.exists():
        pytest.skip("helm is not in .tools/bin: run `make tools`")
    cmd = [str(HELM), "template", "overlap", str(REPO / "charts" / "overlap"), "--namespace", NAMESPACE]
    rendered = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    done = cluster.apply("-f", "-", stdin=rendered)
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered) if doc}
    assert kinds == {"ServiceAccount", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Service",
                     "Deployment", "Pod", "ConfigMap", "Role", "RoleBinding"}  # fmt: skip
    assert done.stdout.count("\n") == len([d for d in yaml.safe_load_all(rendered) if d])


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_applies(cluster, path) -> None:
    done = cluster.apply("-f", str(path))
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            assert f"{doc['metadata']['name']} created" in done.stdout, done.stdout


def test_the_helm_test_script_deletes_its_service_when_helm_stops_it(cluster) -> None:
    """Helm deletes the test pod past its timeout (SIGTERM): the script's service goes with it; and a service an
    earlier run killed outright left behind does not stop the next run. No operator here: the service never gets
    Ready."""
    script = REPO / "charts" / "overlap" / "files" / "tests" / "serve-check.py"
    leftover = cluster.apply("-f", "-", stdin=(
        "apiVersion: overlap.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: overlap-helm-test}\n"
        "spec: {model: {servedName: tiny, path: /models/tiny}}\n"))  # fmt: skip
    assert "created" in leftover.stdout
    old_uid = cluster.service("overlap-helm-test")["metadata"]["uid"]
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    proc = subprocess.Popen([sys.executable, str(script), NAMESPACE, "--timeout-s", "60"], env=env)
    try:
        wait_for(lambda: _uid(cluster, "overlap-helm-test") not in (None, old_uid), timeout=30,
                 what="the script's own test service")  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 143
    finally:
        proc.kill()
    assert cluster.get("inferenceservice", "overlap-helm-test") is None


def _uid(cluster, name: str) -> str | None:
    found = cluster.get("inferenceservice", name)
    return None if found is None else found["metadata"]["uid"]
