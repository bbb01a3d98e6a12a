"""The node agent's parts that need no podman (the pods themselves run in `make e2e`): kubelet's atomic volume
writer, quantities, probes, and the Service proxy's round robin over real sockets."""

from __future__ import annotations

import socket
import threading

from tests.support.node_agent import (
    Probe,
    ServiceProxy,
    cpu_quantity,
    memory_bytes,
    rolling_limits,
    write_atomic_volume,
)


def test_volume_updates_swap_all_files_at_once(tmp_path):
    write_atomic_volume(tmp_path, {"engine.json": "{}", "extra": "a"}, "v1")
    assert (tmp_path / "engine.json").read_text() == "{}" and (tmp_path / "engine.json").is_symlink()
    first_target = (tmp_path / "..data").resolve()
    write_atomic_volume(tmp_path, {"engine.json": '{"max_num_seqs": 4}', "extra": "b"}, "v2")
    assert (tmp_path / "engine.json").read_text() == '{"max_num_seqs": 4}' and (tmp_path / "extra").read_text() == "b"
    assert (tmp_path / "..data").resolve() != first_target and not first_target.exists()  # the old set is gone


def test_quantities_as_kubernetes_writes_them():
    assert cpu_quantity("500m") == 0.5 and cpu_quantity("2") == 2 and cpu_quantity(4) == 4
    assert memory_bytes("2Gi") == 2 << 30 and memory_bytes("512Mi") == 512 << 20 and memory_bytes("1G") == 10**9


def test_probe_needs_failure_threshold_failures_to_flip(tmp_path):
    probe = Probe.parse({"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
                        {"http": 1})  # fmt: skip
    assert probe.port == 1 and probe.period_s == 5

    def no_exec(command, timeout):
        raise AssertionError("an HTTP probe runs no command")

    assert probe.check("127.0.0.1", now=0, run=no_exec) is None  # one failure: no verdict yet
    assert probe.next_at == 5
    assert probe.check("127.0.0.1", now=5, run=no_exec) is False


def test_an_exec_probe_runs_its_command_in_the_container_with_its_timeout():
    probe = Probe.parse({"exec": {"command": ["python", "-m", "probe"]}, "timeoutSeconds": 7, "failureThreshold": 1},
                        {})  # fmt: skip
    runs = []
    assert probe.check("10.0.0.9", now=0, run=lambda command, timeout: runs.append((command, timeout)) or True)
    assert probe.check("10.0.0.9", now=10, run=lambda command, timeout: False) is False
    assert runs == [(["python", "-m", "probe"], 7)]


def _echo_server(reply: bytes) -> tuple[int, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with server:
            for _ in range(2):
                conn, _ = server.accept()
                with conn:
                    conn.recv(100)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def test_the_service_proxy_round_robins_connections_and_refuses_without_endpoints():
    a, b = _echo_server(b"a"), _echo_server(b"b")
    endpoints = [("127.0.0.1", a[0]), ("127.0.0.1", b[0])]
    proxy = ServiceProxy("svc", lambda: endpoints)
    try:
        seen = []
        for _ in range(4):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as conn:
                conn.sendall(b"hi")
                seen.append(conn.recv(10))
        assert sorted(seen) == [b"a", b"a", b"b", b"b"] and seen[0] != seen[1]
        endpoints.clear()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as conn:
            assert conn.recv(10) == b""  # closed at once: no ready endpoint
    finally:
        proxy.close()


def test_rolling_limits_read_counts_and_percentages_as_the_deployment_controller_does():
    assert rolling_limits({"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, 3) == (1, 0)
    assert rolling_limits({"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}, 3) == (1, 0)
    assert rolling_limits({}, 8) == (2, 2)  # Kubernetes' defaults: 25% each
