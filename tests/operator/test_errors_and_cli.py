"""API errors become kopf's retry or stop signals; the `overlap operator` command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import kopf
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from overlap.cli import build_parser
from overlap.operator import kube
from overlap.operator.settings import MEMO_KEY, OperatorSettings, SettingsError, settings_of


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


def settings_for(*argv: str, **environ: str) -> OperatorSettings:
    return OperatorSettings.from_args(build_parser().parse_args(["operator", *argv]), environ)


def test_the_operators_settings_come_from_its_flags_else_the_environment() -> None:
    defaults = OperatorSettings((), "", signal_window_s=60, api_timeout_s=30, resync_s=60, model_image=None)
    assert settings_for() == OperatorSettings() == defaults
    environ = {
        "OVERLAP_PROMETHEUS_URL": "http://prom:9090",
        "OVERLAP_SIGNAL_WINDOW_S": "30",
        "OVERLAP_API_TIMEOUT_S": "5",
        "OVERLAP_RESYNC_S": "3",
        "OVERLAP_MODEL_IMAGE": "r.example/o:1",
    }
    assert settings_for(**environ) == OperatorSettings((), "http://prom:9090", 30, 5, 3, "r.example/o:1")
    flags = ["--namespace", "a", "-n", "b", "--prometheus-url", "http://p", "--signal-window-s", "10",
             "--api-timeout-s", "7", "--resync-s", "2", "--model-image", "mine:2"]  # fmt: skip
    assert settings_for(*flags, **environ) == OperatorSettings(("a", "b"), "http://p", 10, 7, 2, "mine:2")  # flags win
    empty = dict.fromkeys(environ, "")  # an empty variable is unset
    assert settings_for(**empty) == OperatorSettings()


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--resync-s", "0.5"], {}, "--resync-s (OVERLAP_RESYNC_S) must be >= 1, got 0.5"),
        ([], {"OVERLAP_RESYNC_S": "0"}, "--resync-s (OVERLAP_RESYNC_S) must be >= 1, got 0"),
        (["--api-timeout-s", "0"], {}, "--api-timeout-s (OVERLAP_API_TIMEOUT_S) must be > 0, got 0"),
        ([], {"OVERLAP_SIGNAL_WINDOW_S": "0.5"}, "--signal-window-s (OVERLAP_SIGNAL_WINDOW_S) must be >= 1, got 0.5"),
        ([], {"OVERLAP_API_TIMEOUT_S": "30s"}, "OVERLAP_API_TIMEOUT_S must be a number of seconds, got '30s'"),
    ],
)
def test_settings_out_of_range_stop_the_operator_before_it_starts(argv, environ, message, monkeypatch) -> None:
    with pytest.raises(SettingsError) as caught:
        settings_for(*argv, **environ)
    assert str(caught.value) == message
    for name in ("OVERLAP_RESYNC_S", "OVERLAP_API_TIMEOUT_S", "OVERLAP_SIGNAL_WINDOW_S"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["operator", *argv])
    with pytest.raises(SystemExit) as exited:  # `overlap operator` says so and exits, before it connects
        args.func(args)
    assert exited.value.code == f"overlap operator: {message}"


def test_the_settings_are_frozen_and_reach_the_handlers_in_kopfs_memo() -> None:
    settings = settings_for("--resync-s", "5")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.resync_s = 1  # type: ignore[misc]
    assert settings_of(kopf.Memo({MEMO_KEY: settings})) is settings
    assert settings_of(kopf.Memo()) == OperatorSettings()  # kopf started without them: the defaults


def test_only_the_cli_reads_the_environment() -> None:
    """The operator's settings are read once, by `overlap operator` (OperatorSettings.from_args); no module reads
    the environment at call time."""
    package = Path(kube.__file__).parent
    readers = [
        path.relative_to(package).as_posix()
        for path in sorted(package.rglob("*.py"))
        if "os.environ" in path.read_text() or "getenv" in path.read_text()
    ]
    assert readers == ["cli.py"]


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
