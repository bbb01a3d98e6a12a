"""API errors become kopf's retry or stop signals; the `overlap operator` command line."""

from __future__ import annotations

import json

import kopf
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from overlap.cli import build_parser
from overlap.operator import kube


def api_exception(status: int, message: str = "boom") -> ApiException:
    exc = ApiException(status=status, reason="Reason")
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


@pytest.mark.parametrize("status", [403, 409, 429, 500, 503, 504])
def test_transient_api_errors_retry_with_a_delay(status: int) -> None:
    with pytest.raises(kopf.TemporaryError) as caught, kube.api_errors("applying Deployment ns/x"):
        raise api_exception(status, "etcd is slow")
    assert caught.value.delay == kube.RETRY_DELAY_S
    assert f"applying Deployment ns/x: {status} etcd is slow; retrying in 2 s" == str(caught.value)


def test_the_retry_delay_backs_off_exponentially_up_to_a_minute() -> None:
    delays = []
    for retry in (0, 1, 2, 3, 10):
        token = kube.HANDLER_RETRY.set(retry)
        try:
            delays.append(kube.retry_delay())
        finally:
            kube.HANDLER_RETRY.reset(token)
    assert delays == [2, 4, 8, 16, 60]


def test_a_dropped_connection_retries() -> None:
    with pytest.raises(kopf.TemporaryError), kube.api_errors("reading"):
        raise urllib3.exceptions.ProtocolError("connection reset")


@pytest.mark.parametrize("status", [400, 404, 422])
def test_refusals_stop_with_the_servers_message(status: int) -> None:
    with pytest.raises(kopf.PermanentError, match=r"spec\.replicas: Invalid value"), kube.api_errors("x"):
        raise api_exception(status, "spec.replicas: Invalid value")


def test_operator_command_line() -> None:
    parser = build_parser()
    args = parser.parse_args(["operator", "--namespace", "a", "--namespace", "b", "--metrics-port", "9090"])
    assert args.namespace == ["a", "b"] and args.peering is None and args.metrics_port == 9090
    assert parser.parse_args(["operator", "--all-namespaces"]).namespace is None
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "--namespace", "a", "--all-namespaces"])
    with pytest.raises(SystemExit):
        parser.parse_args(["operator", "--standalone", "--peering", "p"])


def test_the_pods_command_lines_parse_with_the_real_overlap_command(tmp_path, monkeypatch) -> None:
    """The deployment contract: what the operator puts in the pod is what `overlap engine` / `overlap sidecar`
    accept (parsed by the real parser, the sidecar's into its SidecarConfig, the flags' single source; nothing
    runs)."""
    from overlap.operator import children
    from overlap.operator import spec as specs
    from overlap.sidecar.config import SidecarConfig

    spec = specs.with_defaults(
        {"model": {"servedName": "m", "path": "/m"}, "sidecar": {"apiKeySecret": {"name": "key"}}}
    )
    deployment = children.build_deployment("m", "ns", spec, specs.check_spec(spec))
    parser = build_parser()
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        assert container["command"] == ["overlap"]
        args = parser.parse_args(container["args"])
        assert args.command == container["args"][0]
        if args.command == "sidecar":
            assert args.engine_socket == children.SOCKET
            assert args.api_key_env == children.API_KEY_ENV
            # the Secret mounts, as the pod would have them
            (tmp_path / "token").write_text("admin-token-0123456789")
            args.admin_token_file = str(tmp_path / "token")
            monkeypatch.setenv(children.API_KEY_ENV, "sk-key")
            config = SidecarConfig.from_args(args)
            assert (config.engine_socket, config.admin_port, config.api_key) == (
                children.SOCKET, spec["sidecar"]["adminPort"], "sk-key",
            )  # fmt: skip
            assert config.max_inflight == spec["sidecar"]["maxInflight"]


def test_the_operator_waits_for_the_crd_and_exits_when_it_never_comes(tmp_path) -> None:
    """kopf started before the CRD sits idle with its liveness probe passing: the operator waits for the CRD instead,
    saying so, starts watching once it is applied, and exits 1 with the reason if it never is."""
    from tests.support.cluster import (
        CRD_FILE,
        NAMESPACE,
        ApiThread,
        Cluster,
        OperatorProcess,
        wait_for,
        write_kubeconfig,
    )

    api_thread = ApiThread()
    try:
        kubeconfig = write_kubeconfig(tmp_path / "config", api_thread.url, NAMESPACE)
        never = OperatorProcess(kubeconfig, tmp_path / "never.log", "--namespace", NAMESPACE, "--crd-wait-s", "1")
        assert never.proc.wait(30) == 1
        never.stop()
        assert "the InferenceService CRD (inferenceservices.overlap.dev) is not installed after 1 s" in never.log()
        later = OperatorProcess(kubeconfig, tmp_path / "later.log", "--namespace", NAMESPACE, "--crd-wait-s", "60")
        try:
            wait_for(lambda: "is not installed; waiting for it" in later.log(), timeout=30, what="the wait")
            Cluster(api_thread, kubeconfig).apply("-f", str(CRD_FILE))
            wait_for(lambda: "Starting the watch" in later.log(), timeout=30, what="the watch after the CRD")
            assert later.proc.poll() is None
        finally:
            later.stop()
    finally:
        api_thread.close()
