"""`SidecarConfig` is the single source of the sidecar's flags: the parser, the config and the command line that
`overlap serve` and the operator hand to a sidecar all come from its flag table."""

from __future__ import annotations

import dataclasses

import pytest

from overlap.cli import build_parser
from overlap.engine.errors import ConfigError
from overlap.sidecar.config import FLAGS, SidecarConfig

TOKEN = "admin-token-0123456789"


def _parse(argv: list[str]):
    return build_parser().parse_args(["sidecar", *argv])


def test_every_field_but_the_secrets_and_the_poll_interval_is_a_flag() -> None:
    fields = {f.name for f in dataclasses.fields(SidecarConfig)}
    assert fields - {f.field for f in FLAGS} == {"engine_socket", "admin_token", "api_key", "stats_interval_s"}


def test_to_argv_round_trips_through_the_real_parser(tmp_path, monkeypatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("TEST_API_KEY", "sk-test-key")
    config = SidecarConfig(
        engine_socket="/run/engine.sock", host="0.0.0.0", port=8123, admin_port=8124, admin_token_file=str(token_file),
        api_key_env="TEST_API_KEY", served_model_name="m", max_queued_requests=7, max_queued_tokens=999,
        max_inflight=9, request_timeout_s=12.5, max_body_bytes=4096, grace_period_s=3.0, watch_config="/cfg.yaml",
        watch_interval_s=0.25, admin_token=TOKEN, api_key="sk-test-key",
    )  # fmt: skip
    argv = config.to_argv()
    assert TOKEN not in " ".join(argv) and "sk-test-key" not in " ".join(argv), "secrets travel by reference only"
    assert SidecarConfig.from_args(_parse(argv)) == config


def test_flags_default_to_their_environment_variables(monkeypatch) -> None:
    monkeypatch.setenv("OVERLAP_MAX_INFLIGHT", "17")
    monkeypatch.setenv("OVERLAP_REQUEST_TIMEOUT_S", "2.5")
    config = SidecarConfig.from_args(_parse(["--engine-socket", "/s"]))
    assert (config.max_inflight, config.request_timeout_s, config.host) == (17, 2.5, "0.0.0.0")


def test_a_bad_environment_value_is_a_usage_error_not_a_traceback(monkeypatch, capsys) -> None:
    monkeypatch.setenv("OVERLAP_PORT", "eighty")
    with pytest.raises(SystemExit) as caught:
        _parse(["--engine-socket", "/s"])
    assert caught.value.code == 2
    assert "--port: invalid int value: 'eighty'" in capsys.readouterr().err


def test_an_admin_port_without_a_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="--admin-port needs --admin-token-file or --admin-token-env"):
        SidecarConfig.from_args(_parse(["--engine-socket", "/s", "--admin-port", "8001"]))
