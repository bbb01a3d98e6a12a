"""The engine pod's probes. The engine holds the GPU, so its probes are its own: kubelet restarts the engine
container when its model load outlasts startupSeconds or its loop stops answering (liveness waits until the startup
probe has passed). The sidecar's decide whether the Service sends the pod requests."""

from __future__ import annotations

from typing import Any

from overlap.operator.children.pod import SOCKET

STARTUP_PROBE_PERIOD_S = 2  # the engine is ready within this of its model load (a failed probe is cheap)
# The engine's model load may take this long when spec.pod.startupSeconds is unset; past it kubelet restarts the
# engine container, so a load that hangs never holds its GPU for good.
DEFAULT_STARTUP_S = 3600
# The engine's own probe: asks it over its socket for stats (overlap.engine.serving.probe; only the wire protocol is
# imported, about 0.2 s of CPU a run). The engine answers between steps, and one step of a large model on a CPU can
# take many seconds: a liveness verdict takes three misses of ENGINE_PROBE_TIMEOUT_S each, over a minute.
ENGINE_PROBE_TIMEOUT_S = 20
ENGINE_PROBE = ["python", "-m", "overlap.engine.serving.probe", "--socket", SOCKET, "--timeout",
                str(ENGINE_PROBE_TIMEOUT_S)]  # fmt: skip


def engine_probes(startup_s: int) -> dict[str, Any]:
    """The engine container's startup probe (it may take `startup_s` to load its model) and liveness probe."""
    return {
        "startupProbe": {
            "exec": {"command": ENGINE_PROBE},
            "periodSeconds": STARTUP_PROBE_PERIOD_S,
            "timeoutSeconds": ENGINE_PROBE_TIMEOUT_S + 5,
            "failureThreshold": -(-startup_s // STARTUP_PROBE_PERIOD_S),
        },
        "livenessProbe": {
            "exec": {"command": ENGINE_PROBE},
            "periodSeconds": 10,
            "timeoutSeconds": ENGINE_PROBE_TIMEOUT_S + 5,
            "failureThreshold": 3,
        },
    }


def sidecar_probes() -> dict[str, Any]:
    """/readyz is 503 while the engine is away (crashed, restarting): the Service stops sending this pod new
    requests within two periods. Two misses, so one slow answer under load does not pull a busy pod out.
    Timeouts that hold under load: the sidecar answers probes on the event loop that streams every response, and
    with kubelet's default of 1 s a busy sidecar misses them (readiness drops the pod, liveness restarts it and cuts
    its streams)."""
    return {
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 2,
            "timeoutSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
    }
