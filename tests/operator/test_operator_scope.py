"""Which namespaces the operator serves: `--all-namespaces` serves every one, `--namespace NS` only NS."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.support.cluster import NAMESPACE, REPO, running_operator, wait_for

EXAMPLE = (REPO / "examples" / "inferenceservice.yaml").read_text()
NAME = yaml.safe_load(EXAMPLE)["metadata"]["name"]


def test_all_namespaces_serves_every_namespace(cluster, tmp_path_factory) -> None:
    with running_operator(cluster, tmp_path_factory.mktemp("clusterwide"), "--all-namespaces"):
        for namespace in ("team-a", "team-b"):
            cluster.apply("-n", namespace, "-f", "-", stdin=EXAMPLE)
        for namespace in ("team-a", "team-b"):
            wait_for(lambda ns=namespace: cluster.get("deployment", NAME, ns), what=f"a Deployment in {namespace}")


def test_one_namespace_ignores_the_others(cluster, tmp_path_factory) -> None:
    folder = tmp_path_factory.mktemp("namespaced")
    with running_operator(cluster, folder, "--namespace", NAMESPACE) as proc:
        cluster.apply("-n", "team-c", "-f", "-", stdin=EXAMPLE.replace(f"name: {NAME}", "name: ignored"))
        cluster.apply("-f", "-", stdin=EXAMPLE.replace(f"name: {NAME}", "name: served"))
        wait_for(lambda: cluster.get("deployment", "served"), what="the Deployment in the watched namespace")
        time.sleep(0.5)
        assert cluster.get("deployment", "ignored", "team-c") is None
        assert "team-c" not in proc.log()


def test_a_restarted_operator_catches_up(cluster, tmp_path_factory) -> None:
    """Changes made while the operator was down are applied when it comes back (kopf resume/update)."""
    manifest = EXAMPLE.replace(f"name: {NAME}", "name: resumed")
    with running_operator(cluster, tmp_path_factory.mktemp("first"), "--namespace", NAMESPACE):
        cluster.apply("-f", "-", stdin=manifest)
        wait_for(lambda: cluster.get("deployment", "resumed"), what="the Deployment")
    # Operator down: a live knob changes and a child disappears.
    cluster.apply("-f", "-", stdin=manifest.replace("maxNumSeqs: 64", "maxNumSeqs: 24"))
    cluster.kubectl("delete", "pdb", "resumed")
    with running_operator(cluster, tmp_path_factory.mktemp("second"), "--namespace", NAMESPACE):
        wait_for(lambda: cluster.get("pdb", "resumed"), what="the PDB back")
        wait_for(
            lambda: '"max_num_seqs": 24' in cluster.get("configmap", "resumed-engine")["data"]["engine.json"],
            what="the ConfigMap updated",
        )


@pytest.mark.reliability
def test_an_operator_killed_mid_reconcile_converges_when_restarted(cluster, tmp_path_factory, reliability) -> None:
    """SIGKILL while the first reconcile is half done (its ConfigMap and Services written, the Deployment refused
    for now): the next operator finishes it with one of each child and a status that names the generation."""
    manifest = EXAMPLE.replace(f"name: {NAME}", "name: killed")
    cluster.api.fail_next("PATCH", "deployments", status=503, times=3, name="killed")  # holds it at the Deployment
    with running_operator(cluster, tmp_path_factory.mktemp("killed"), "--namespace", NAMESPACE) as proc:
        cluster.apply("-f", "-", stdin=manifest)
        wait_for(lambda: "503" in proc.log() and cluster.get("configmap", "killed-engine"), what="a half reconcile")
        assert cluster.get("deployment", "killed") is None
        proc.proc.kill()  # SIGKILL: no handler runs, no status is written on the way out
        proc.proc.wait(5)
    with running_operator(cluster, tmp_path_factory.mktemp("restarted"), "--namespace", NAMESPACE):
        wait_for(lambda: cluster.get("deployment", "killed"), 30, "the Deployment from the second operator")
        wait_for(lambda: (cluster.service("killed").get("status") or {}).get("observedGeneration") == 1, 30,
                 "the status of generation 1")  # fmt: skip
        counts = {kind: len(json.loads(cluster.kubectl("get", kind, "-l", "overlap.dev/inferenceservice=killed", "-o",
                                                       "json").stdout)["items"])
                  for kind in ("deployment", "configmap", "service", "pdb")}  # fmt: skip
    cluster.kubectl("delete", "oisvc", "killed")
    assert counts == {"deployment": 1, "configmap": 1, "service": 1, "pdb": 1}, counts
    reliability.row(
        "Operator", "SIGKILL mid-reconcile (Deployment write failing), then a new operator",
        load="one InferenceService, its first reconcile half done",
        outcome=f"the new operator finished it: children {counts}, none twice; status at generation 1",
    )  # fmt: skip
