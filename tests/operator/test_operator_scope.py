"""Which namespaces the operator serves: `--all-namespaces` serves every one, `--namespace NS` only NS."""

from __future__ import annotations

import time

from tests.support.cluster import NAMESPACE, REPO, running_operator, wait_for

EXAMPLE = (REPO / "examples" / "inferenceservice.yaml").read_text()


def test_all_namespaces_serves_every_namespace(cluster, tmp_path_factory) -> None:
    with running_operator(cluster, tmp_path_factory.mktemp("clusterwide"), "--all-namespaces"):
        for namespace in ("team-a", "team-b"):
            cluster.apply("-n", namespace, "-f", "-", stdin=EXAMPLE)
        for namespace in ("team-a", "team-b"):
            wait_for(
                lambda ns=namespace: cluster.get("deployment", "llama-small", ns), what=f"a Deployment in {namespace}"
            )


def test_one_namespace_ignores_the_others(cluster, tmp_path_factory) -> None:
    folder = tmp_path_factory.mktemp("namespaced")
    with running_operator(cluster, folder, "--namespace", NAMESPACE) as proc:
        cluster.apply("-n", "team-c", "-f", "-", stdin=EXAMPLE.replace("llama-small", "ignored"))
        cluster.apply("-f", "-", stdin=EXAMPLE.replace("llama-small", "served"))
        wait_for(lambda: cluster.get("deployment", "served"), what="the Deployment in the watched namespace")
        time.sleep(0.5)
        assert cluster.get("deployment", "ignored", "team-c") is None
        assert "team-c" not in proc.log()


def test_a_restarted_operator_catches_up(cluster, tmp_path_factory) -> None:
    """Changes made while the operator was down are applied when it comes back (kopf resume/update)."""
    manifest = EXAMPLE.replace("llama-small", "resumed")
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
