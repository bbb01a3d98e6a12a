"""The control loop: a kopf timer per InferenceService that reads Prometheus, decides, and carries it out.

Each tick (the faster of spec.autoscaling.intervalSeconds and spec.tuning.intervalSeconds, for the loops that
are on): read the signals (overlap.operator.control.signals), `decide` (overlap.operator.control.decide), then

- scale: patch spec.replicas (the operator owns it with autoscaling.mode builtin); the update handler rolls it
  into the Deployment;
- retune: write the LiveKnobs to status.liveKnobs and the ConfigMap (new and restarted pods start tuned), and PUT
  them to every ready pod's admin port (bearer token from the service's Secret). Two paths to a running pod, each
  needed: the PUT applies the move at once, so the tuner's next readings measure it (the kubelet's ConfigMap sync
  takes up to a minute or more); the sidecar's file watch on the ConfigMap reaches a pod whose PUT failed, and
  carries a user's edit of spec.engine's live knobs, which reconcile writes to the ConfigMap only;
- always: status.signals (what it saw), status.lastDecision and the Scaling / Tuned conditions; an Event per move.

The history the windows and cooldowns need lives in kopf's per-object memo: an operator restart starts the
windows afresh, which only delays the next move.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
from prometheus_client import Counter, Gauge

from overlap.engine.config import EngineConfig, LiveKnobs
from overlap.engine.errors import ConfigError
from overlap.operator import admin_tokens, children, kube, status
from overlap.operator import spec as specs
from overlap.operator.control import signals
from overlap.operator.control.decide import decide
from overlap.operator.control.policy import (
    HOLD,
    RETUNE,
    SCALE_DOWN,
    SCALE_UP,
    Current,
    Decision,
    History,
    Policy,
)
from overlap.operator.identity import CR, selector_string
from overlap.operator.locks import service_lock
from overlap.operator.settings import settings_of

# The timer's own period; each service's loop runs at its spec's interval (>= 5 s, the CRD's minimum) on top.
TICK_S = 5.0
ADMIN_TIMEOUT_S = 5.0

DECISIONS = Counter("overlap_operator_decisions_total", "Control loop decisions carried out", ["action"])
ADVICE = Counter(
    "overlap_operator_advice_total", "Decisions advised, not applied (autoscaling.mode advise)", ["action"]
)
_SERVICE = ["namespace", "service"]
FORECAST = Gauge("overlap_operator_forecast_arrival_rate", "Arrival rate the floor expects a horizon ahead", _SERVICE)
FORECAST_ERROR = Gauge(
    "overlap_operator_forecast_relative_error", "Smoothed |forecast - actual| / actual of past forecasts", _SERVICE
)
CAPACITY = Gauge(
    "overlap_operator_capacity_per_replica", "Requests/s a saturated replica was measured to finish", _SERVICE
)
FLOOR = Gauge("overlap_operator_replica_floor", "Replicas the forecast needs at the target utilisation", _SERVICE)

_EVENT_REASONS = {SCALE_UP: "ScaledUp", SCALE_DOWN: "ScaledDown", RETUNE: "Retuned"}


@dataclass
class LoopState:
    history: History
    last_tick: float = -math.inf


def _controlled(spec: Mapping[str, Any], **_: Any) -> bool:
    """Only services with a loop on get the timer, and with it kopf's finalizer."""
    full = specs.with_defaults(spec or {})
    return full["autoscaling"]["mode"] in specs.SCALING_MODES or bool(full["tuning"]["enabled"])


@kopf.timer(*CR, interval=TICK_S, initial_delay=TICK_S, when=_controlled)
def control_tick(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    settings = settings_of(memo)
    spec = specs.with_defaults(body.get("spec") or {}, settings.model_image)
    try:
        config = specs.check_spec(spec)
    except specs.SpecError:
        return  # reconcile reports it as Degraded; nothing to control
    policy = Policy.from_spec(spec, signal_window_s=settings.signal_window_s)
    now = time.time()
    state: LoopState = memo.setdefault(
        "control", LoopState(History(scaling=policy.scaling, signal_window_s=policy.tuning.signal_window_s))
    )
    state.history.follow(policy.scaling)  # the spec may have been edited since the last tick
    if now - state.last_tick < policy.interval_s() - TICK_S / 2:
        return  # not due (or both loops off: the interval is infinite)
    state.last_tick = now
    with service_lock(body["metadata"]["uid"]):  # no reconcile or resync writes an older plan meanwhile
        run_tick(body, spec, config, policy, state, now, logger, settings.prometheus_url)


def run_tick(
    body: Mapping[str, Any],
    spec: Mapping[str, Any],
    config: EngineConfig,
    policy: Policy,
    state: LoopState,
    now: float,
    logger: logging.Logger,
    prometheus_url: str,
) -> Decision | None:
    """One pass of the loop for one service; the decision carried out, or None when there were no signals.
    `prometheus_url`: the operator's (--prometheus-url), read when the spec names none."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    current_status = body.get("status") or {}
    base_url = spec["prometheus"].get("url") or prometheus_url
    when = status.now_iso()
    if not base_url:
        problem = "no Prometheus to read: set spec.prometheus.url or the operator's --prometheus-url"
        kube.patch_status(name, namespace, lambda cur: _loop_conditions(cur, policy, None, problem, when))
        return None
    window_s = policy.tuning.signal_window_s
    queries = signals.queries_for(namespace, name, spec["prometheus"].get("queries"), window_s)
    try:
        reading = signals.read_signals(
            base_url, queries, ready_replicas=current_status.get("readyReplicas") or 0, now=now
        )
    except signals.PrometheusError as exc:
        problem = str(exc)
        logger.warning(f"control loop: {problem}")
        kube.patch_status(name, namespace, lambda cur: _loop_conditions(cur, policy, None, problem, when))
        return None

    engine = specs.tuned_config(config, spec, current_status)
    decision = decide(reading, Current(spec["replicas"], engine.live), state.history, policy)
    advise = policy.scaling.mode == "advise"
    if decision.action == RETUNE and not advise:
        try:
            engine = engine.with_live(decision.engine)
        except ConfigError as exc:  # a move the engine refuses (e.g. budget below max_seq_len): hold instead
            decision = Decision(HOLD, f"retune refused by the engine config: {exc}", decision.replicas, engine.live)
    if decision.action in (SCALE_UP, SCALE_DOWN) and not advise:
        kube.scale(name, namespace, decision.replicas)
    state.history.record(reading, decision)
    forecast = _forecast_status(state.history, decision, reading)
    _export_forecast(namespace, name, forecast)

    def compute(cur: dict[str, Any]) -> dict[str, Any]:
        new = _loop_conditions(cur, policy, decision, None, when, reading.stale)
        stored = cur.get("status") or {}
        new["signals"] = _whole(stored.get("signals"), signals.to_status(reading))
        new["forecast"] = _whole(stored.get("forecast"), forecast)
        if decision.action != HOLD:
            key = "lastAdvice" if advise else "lastDecision"
            new[key] = _whole(stored.get(key), decision.to_status(when))
        if decision.action == RETUNE and not advise:
            new["liveKnobs"] = _whole(stored.get("liveKnobs"), engine.live.to_camel())
        return new

    kube.patch_status(name, namespace, compute)
    if advise:
        if decision.action == HOLD:
            logger.debug(f"control loop (advise): hold: {decision.reason}")
        else:
            ADVICE.labels(decision.action).inc()
            logger.info(f"control loop (advise): would {decision.action} to {decision.replicas}: {decision.reason}")
            message = f"would {decision.action} (replicas {decision.replicas}): {decision.reason}"
            kopf.info(dict(body), reason="Advised", message=message)
        return decision
    if decision.action == RETUNE:
        # After the status: a reconcile builds the ConfigMap from status.liveKnobs, so it must hold the new
        # knobs before the ConfigMap changes (or the operator's own drift repair would put the old ones back).
        _retune(body, spec, engine, logger)
    if decision.action != HOLD:
        DECISIONS.labels(decision.action).inc()
        logger.info(f"control loop: {decision.action}: {decision.reason}")
        kopf.info(dict(body), reason=_EVENT_REASONS[decision.action], message=decision.reason)
    else:
        logger.debug(f"control loop: hold: {decision.reason}")
    return decision


def _whole(stored: Mapping[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new` as a merge patch that replaces the stored object whole: a key it no longer has (a signal with no reading
    this tick, a knob no longer set) is written null, which deletes it, instead of keeping its last value."""
    return {**{key: None for key in stored or {} if key not in new}, **new}


def _forecast_status(history: History, decision: Decision, reading: signals.Signals) -> dict[str, Any]:
    """status.forecast: what the predictive floor expects and how well its past forecasts did."""
    fields = {
        "horizonSeconds": history.horizon_s(),
        "coldStartSeconds": history.cold_start.seconds(),
        "arrivalRate": history.expected_rate(reading.time),
        "relativeError": history.forecast.relative_error,
        "capacityPerReplica": history.capacity.get(decision.engine.max_num_seqs),
        "floor": decision.floor,
    }
    return {
        key: round(value, 4) if isinstance(value, float) else value
        for key, value in fields.items()
        if value is not None
    }


def _export_forecast(namespace: str, name: str, forecast: Mapping[str, Any]) -> None:
    for gauge, key in ((FORECAST, "arrivalRate"), (FORECAST_ERROR, "relativeError"), (CAPACITY, "capacityPerReplica"),
                       (FLOOR, "floor")):  # fmt: skip
        if key in forecast:
            gauge.labels(namespace, name).set(forecast[key])


def _retune(body: Mapping[str, Any], spec: Mapping[str, Any], engine: EngineConfig, logger: logging.Logger) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    kube.apply(children.adopt(children.build_configmap(name, namespace, engine), body))
    token, _ = admin_tokens.ensure(body)
    for pod_ip in kube.ready_pod_ips(namespace, selector_string(name)):
        url = f"http://{pod_ip}:{spec['sidecar']['adminPort']}/admin/config"
        try:
            put_admin_config(url, token, engine.live)
        except OSError as exc:  # that pod gets it from the ConfigMap file instead
            logger.warning(f"control loop: PUT {url} failed ({exc}); the pod picks the change up from the file")


def put_admin_config(url: str, token: str, knobs: LiveKnobs) -> dict[str, Any]:
    """PUT /admin/config on one sidecar; what it applied."""
    request = urllib.request.Request(
        url,
        data=json.dumps(knobs.to_dict()).encode(),
        method="PUT",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise OSError(f"{exc.code} {exc.read()[:200].decode(errors='replace')}") from exc


def _loop_conditions(
    owner: Mapping[str, Any],
    policy: Policy,
    decision: Decision | None,
    problem: str | None,
    when: str,
    stale: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Scaling and Tuned conditions for the loops that are on (messages stay stable while holding, so a quiet
    service's status is not rewritten every tick)."""
    generation = (owner.get("status") or {}).get("observedGeneration")
    new = []
    if policy.scaling.scales:
        if problem is not None:
            new.append(status.condition(status.SCALING, None, "NoSignals", problem, generation, when))
        elif stale:
            message = f"holding: the queries for {', '.join(stale)} failed this tick"
            new.append(status.condition(status.SCALING, None, "StaleSignals", message, generation, when))
        elif decision.action in (SCALE_UP, SCALE_DOWN) and policy.scaling.mode == "advise":
            message = f"advise mode, not applied: would {decision.action} to {decision.replicas}: {decision.reason}"
            new.append(status.condition(status.SCALING, False, "Advised", message, generation, when))
        elif decision.action in (SCALE_UP, SCALE_DOWN):
            reason = _EVENT_REASONS[decision.action]
            new.append(status.condition(status.SCALING, True, reason, decision.reason, generation, when))
        else:
            message = "replicas follow the predictive floor, the queue watermark and the SLO law"
            new.append(status.condition(status.SCALING, False, "Stable", message, generation, when))
    if policy.tuning.enabled:
        if problem is not None:
            new.append(status.condition(status.TUNED, None, "NoSignals", problem, generation, when))
        elif decision.action == RETUNE and policy.scaling.mode != "advise":
            new.append(status.condition(status.TUNED, True, "Retuned", decision.reason, generation, when))
    old = (owner.get("status") or {}).get("conditions") or []
    return {"conditions": status.merge_conditions(old, new)}
