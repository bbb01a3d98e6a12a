"""The chart's rendered manifests and every example apply with the real kubectl (`helm template | kubectl apply`;
`helm install` needs a real cluster)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.support.cluster import NAMESPACE, REPO

HELM = REPO / ".tools" / "bin" / "helm"


def test_helm_template_applies(cluster) -> None:
    if not HELM.exists():
        pytest.skip("helm is not in .tools/bin: run `make tools`")
    cmd = [str(HELM), "template", "overlap", str(REPO / "charts" / "overlap"), "--namespace", NAMESPACE,
           "--set", "exampleInferenceService.enabled=true"]  # fmt: skip
    rendered = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    done = cluster.apply("-f", "-", stdin=rendered)
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered) if doc}
    assert kinds == {"ServiceAccount", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Service",
                     "Deployment", "Pod", "InferenceService", "ConfigMap", "Role", "RoleBinding"}  # fmt: skip
    assert done.stdout.count("\n") == len([d for d in yaml.safe_load_all(rendered) if d])
    example = cluster.service("example")
    assert example["spec"]["engine"]["maxNumSeqs"] == 64  # defaulted by the CRD the chart installed


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_applies(cluster, path) -> None:
    done = cluster.apply("-f", str(path))
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            assert f"{doc['metadata']['name']} created" in done.stdout, done.stdout
