"""Fixtures for the operator tests: the emulated cluster and `overlap operator` against it, each started once per
test module and stopped by PID (the harness is tests.support.cluster)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import (
    CRD_FILE,
    KUBECTL,
    NAMESPACE,
    ApiThread,
    Cluster,
    OperatorProcess,
    running_operator,
    write_kubeconfig,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An emulated API server with the InferenceService CRD applied (by kubectl, as a user would)."""
    if not KUBECTL.exists():
        pytest.skip("kubectl is not in .tools/bin: run `make tools`")
    api_thread = ApiThread()
    try:
        kubeconfig = write_kubeconfig(tmp_path_factory.mktemp("kube") / "config", api_thread.url, NAMESPACE)
        cluster = Cluster(api_thread, kubeconfig)
        cluster.apply("-f", str(CRD_FILE))
        yield cluster
    finally:
        api_thread.close()


API_TIMEOUT_S = 5
RESYNC_S = 3  # the operator puts every service's children right this often (60 s by default)


@pytest.fixture(scope="module")
def operator_process(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """`overlap operator --namespace overlap-test --standalone` running against the emulated API, giving up on a
    request after API_TIMEOUT_S (the emulator answers in milliseconds; a test holds one request longer) and
    resyncing every RESYNC_S."""
    with running_operator(
        cluster,
        tmp_path_factory.mktemp("operator"),
        "--namespace",
        NAMESPACE,
        "--standalone",
        "--api-timeout-s",
        str(API_TIMEOUT_S),
        "--resync-s",
        str(RESYNC_S),
    ) as proc:
        yield proc
