"""Status per the Kubernetes API conventions: conditions with reasons, computed by pure functions.

Condition types: Ready (pods serve), Progressing (a rollout or scale is under way), Degraded (the operator cannot
do what the spec asks), ModelReady (a fetched model.uri, and a draft_model's draft, are in the pods' cache); Scaling
and Tuned belong to the control loop and use the same helpers.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from overlap.engine.config import LiveKnobs

READY, PROGRESSING, DEGRADED, SCALING, TUNED = "Ready", "Progressing", "Degraded", "Scaling", "Tuned"
MODEL_READY = "ModelReady"


def now_iso() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    kind: str, status: bool | None, reason: str, message: str, generation: int | None, when: str
) -> dict[str, Any]:
    text = "Unknown" if status is None else "True" if status else "False"
    result = {"type": kind, "status": text, "reason": reason, "message": message, "lastTransitionTime": when}
    if generation is not None:
        result["observedGeneration"] = generation
    return result


def merge_conditions(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`old` with `new` applied by type; lastTransitionTime only moves when the status itself changes."""
    by_type = {c["type"]: dict(c) for c in old}
    for cond in new:
        previous = by_type.get(cond["type"])
        merged = dict(cond)
        if previous is not None and previous.get("status") == cond["status"]:
            merged["lastTransitionTime"] = previous.get("lastTransitionTime", cond["lastTransitionTime"])
        by_type[cond["type"]] = merged
    return list(by_type.values())


# Waiting reasons that are a pod on its way up, not a problem.
_STARTING = {"ContainerCreating", "PodInitializing"}


def init_container(pod: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The pod's status of its init container `name` ({} before kubelet reports it)."""
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    return next((c for c in statuses if c.get("name") == name), {})


def pods_running(pods: Sequence[Mapping[str, Any]], container: str, args: Sequence[str]) -> list[Mapping[str, Any]]:
    """The pods whose init container `container` runs with `args` (during a rollout the old ReplicaSet's pods still
    run the last spec's)."""

    def runs(pod: Mapping[str, Any]) -> bool:
        containers = (pod.get("spec") or {}).get("initContainers") or []
        return any(c.get("name") == container and c.get("args") == list(args) for c in containers)

    return [pod for pod in pods if runs(pod)]


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_problems(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why pods are not ready, in the scheduler's or kubelet's words: no node for it (a GPU, a claim, a label
    missing), a container waiting (ErrImagePull, CrashLoopBackOff, ...) or restarted, a failed pod, or a readiness
    probe that keeps failing."""
    problems = []
    for pod in pods:
        name, pod_status = pod["metadata"]["name"], pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue
        if pod_is_ready(pod):
            continue
        conditions = {c.get("type"): c for c in pod_status.get("conditions") or []}
        ready, scheduled = conditions.get("Ready", {}), conditions.get("PodScheduled", {})
        if scheduled.get("status") == "False":  # no node takes it: the scheduler says what is missing
            problems.append(f"pod {name}: {scheduled.get('reason', 'Unschedulable')}: {scheduled.get('message', '')}")
            continue
        found = []
        statuses = [("init container", c) for c in pod_status.get("initContainerStatuses") or []]
        statuses += [("container", c) for c in pod_status.get("containerStatuses") or []]
        for kind, container in statuses:
            state = container.get("state") or {}
            failed = state.get("terminated") or {}
            failed = failed if failed.get("exitCode") else {}  # an init container that failed, not yet restarted
            last = failed or (container.get("lastState") or {}).get("terminated") or {}
            reason = (state.get("waiting") or {}).get("reason") or (failed and (failed.get("reason") or "Error"))
            if kind == "init container" and "running" in state and last.get("exitCode"):
                reason = f"running again after {last.get('reason') or 'Error'}"  # the pod waits on it, not on its apps
            if not reason or reason in _STARTING:
                continue
            text = f"{kind} {container['name']} {reason}"
            if last:
                text += f" (exited with code {last.get('exitCode')}, restarts {container.get('restartCount', 0)})"
            message = (state.get("waiting") or {}).get("message") or last.get("message")
            found.append(text + (f": {message.strip()}" if message else ""))
        if not found and pod_status.get("reason"):
            found.append(f"{pod_status['reason']}: {pod_status.get('message', '')}".rstrip(": "))
        if not found and ready.get("message"):
            found.append(ready["message"])  # e.g. "containers with unready status: [sidecar]"
        problems += [f"pod {name}: {text}" for text in found]
    return problems


def model_condition(
    pods: Sequence[Mapping[str, Any]],
    container: str,
    uri: str,
    when: str,
    generation: int | None,
    progress: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """ModelReady of a fetched model from the pods' fetch init containers: True once one pod has it, else the
    failure in the source's words (the fetch's termination message), else the fetch's progress."""
    done, failed, fetching = [], [], []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        name, fetch = pod["metadata"]["name"], init_container(pod, container)
        state, last = fetch.get("state") or {}, (fetch.get("lastState") or {}).get("terminated") or {}
        ended = state.get("terminated") or {}
        if ended and not ended.get("exitCode"):
            done.append(name)
        elif ended or last:
            failed.append(f"pod {name}: {((ended or last).get('message') or 'the fetch failed').strip()}")
        elif "running" in state:
            fetching.append(f"pod {name}: {(progress or {}).get(name) or f'fetching {uri}'}")
    if done:
        return condition(MODEL_READY, True, "Fetched", f"{uri} is in the cache of {len(done)} pod(s)", generation, when)
    if failed:
        return condition(MODEL_READY, False, "FetchFailed", "; ".join(failed[:2]), generation, when)
    if fetching:
        return condition(MODEL_READY, False, "Fetching", "; ".join(fetching[:2]), generation, when)
    return condition(MODEL_READY, None, "Pending", f"no pod has started fetching {uri} yet", generation, when)


def rollout_conditions(
    desired: int,
    deployment: Mapping[str, Any] | None,
    generation: int | None,
    when: str,
    problems: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Ready and Progressing from the Deployment's status (None: it does not exist yet); `problems` (pod_problems)
    say why replicas are missing."""
    status = (deployment or {}).get("status") or {}
    ready = status.get("readyReplicas") or 0
    updated = status.get("updatedReplicas") or 0
    current = status.get("replicas") or 0
    deployment_gen = (deployment or {}).get("metadata", {}).get("generation")
    observed = status.get("observedGeneration")
    if deployment is None:
        return [
            condition(READY, False, "DeploymentMissing", "the Deployment does not exist yet", generation, when),
            condition(PROGRESSING, True, "Creating", "creating the Deployment", generation, when),
        ]
    if desired == 0:
        ready_cond = condition(READY, False, "ScaledToZero", "spec.replicas is 0", generation, when)
    elif ready >= desired:
        ready_cond = condition(READY, True, "AllReplicasReady", f"{ready}/{desired} replicas ready", generation, when)
    else:
        why = ""
        if problems:
            why = f"; {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        if ready > 0:
            message = f"{ready}/{desired} replicas ready{why}"
            ready_cond = condition(READY, True, "SomeReplicasReady", message, generation, when)
        else:
            ready_cond = condition(
                READY, False, "NoReplicasReady", f"0/{desired} replicas ready{why}", generation, when
            )
    rolled_out = observed is not None and observed == deployment_gen and updated >= desired and current == desired
    if rolled_out and ready >= desired:
        progress = condition(PROGRESSING, False, "RolloutComplete", "all replicas updated and ready", generation, when)
    else:
        progress = condition(
            PROGRESSING, True, "RollingOut", f"{updated} updated, {ready} ready of {desired}", generation, when
        )
    return [ready_cond, progress]


def degraded(problem: str | None, generation: int | None, when: str, reason: str = "InvalidSpec") -> dict[str, Any]:
    if problem is None:
        return condition(DEGRADED, False, "AsExpected", "the spec is applied", generation, when)
    return condition(DEGRADED, True, reason, problem, generation, when)


_DEPLOYMENT_FAILURES = ("ProgressDeadlineExceeded", "ReplicaFailure")


def deployment_degraded(deployment: Mapping[str, Any] | None, generation: int | None, when: str) -> dict[str, Any]:
    """Degraded from the Deployment's own failure conditions: a rollout past its progress deadline, or pods the
    ReplicaSet cannot create (quota, admission); AsExpected otherwise."""
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        message = cond.get("message", "")
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return degraded(f"the rollout stalled: {message}", generation, when, reason="ProgressDeadlineExceeded")
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return degraded(f"pods cannot be created: {message}", generation, when, reason="ReplicaFailure")
    return degraded(None, generation, when)


def service_status(
    owner: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    live_knobs: LiveKnobs,
    *,
    selector: str,
    url: str,
    when: str,
    problems: Sequence[str] = (),
) -> dict[str, Any]:
    """The whole status after a successful reconcile of `owner` (the InferenceService as last read)."""
    generation = owner["metadata"].get("generation")
    desired = owner["spec"].get("replicas", 1)
    dep_status = (deployment or {}).get("status") or {}
    rollout = rollout_conditions(desired, deployment, generation, when, problems)
    conditions = [*rollout, deployment_degraded(deployment, generation, when)]
    return {
        "observedGeneration": generation,
        "replicas": dep_status.get("replicas") or 0,
        "readyReplicas": dep_status.get("readyReplicas") or 0,
        "selector": selector,
        "url": url,
        "liveKnobs": live_knobs.to_camel(),
        "conditions": merge_conditions((owner.get("status") or {}).get("conditions") or [], conditions),
    }


def rollout_status(
    owner: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    when: str,
    problems: Sequence[str] = (),
    model: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The part of the status that follows the Deployment and its pods (replica counts, Ready, Progressing, and
    `model`: ModelReady, for a fetched model)."""
    status = owner.get("status") or {}
    generation = status.get("observedGeneration")
    desired = owner["spec"].get("replicas", 1)
    dep_status = (deployment or {}).get("status") or {}
    new = rollout_conditions(desired, deployment, generation, when, problems)
    failure = deployment_degraded(deployment, generation, when)
    was = next((c for c in status.get("conditions") or [] if c.get("type") == DEGRADED), {})
    # Set Degraded on a Deployment failure, clear it when that failure ends; a spec problem's Degraded stays.
    if failure["status"] == "True" or was.get("reason") in _DEPLOYMENT_FAILURES:
        new.append(failure)
    if model is not None:
        new.append(dict(model))
    return {
        "replicas": dep_status.get("replicas") or 0,
        "readyReplicas": dep_status.get("readyReplicas") or 0,
        "conditions": merge_conditions(status.get("conditions") or [], new),
    }


def degraded_status(owner: Mapping[str, Any], problem: str, when: str, reason: str = "InvalidSpec") -> dict[str, Any]:
    """Degraded=True with the problem; the running pods (if any) are left as they are."""
    generation = owner["metadata"].get("generation")
    old = (owner.get("status") or {}).get("conditions") or []
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(old, [degraded(problem, generation, when, reason)]),
    }
