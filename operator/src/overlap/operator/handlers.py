"""kopf handlers, one concern each. Importing this module registers them (`overlap operator` does).

- `configure`: kopf's settings, once at start-up, from the operator's (`settings_of(memo)`: its flags and
  environment, parsed once by `overlap operator`).
- `reconcile`: on create / update / resume of an InferenceService, make its children match the spec.
- `restore_child`: a child edited or deleted by hand is put back (on the child's own watch event).
- `mirror_rollout`: the Deployment's progress goes into the InferenceService's status.
- `mirror_pods`: a pod's trouble into the status; a ready pod gets spec.adapters loaded (adapter_sync.py, which the
  reconcile and the resync run too).
- `announce_deletion`: deleting an InferenceService; its children go with the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from prometheus_client import Counter

from overlap.operator import adapter_sync, admin_tokens, children, kube, status
from overlap.operator import reconcile as plans
from overlap.operator import spec as specs
from overlap.operator.drift import is_subset
from overlap.operator.identity import CR, INSTANCE_LABEL, KIND, OWNED, selector_string
from overlap.operator.locks import service_lock
from overlap.operator.model_volumes import FETCH_CONTAINER, fetch_args
from overlap.operator.settings import OperatorSettings, settings_of

CHILD_RESOURCES = [("", "v1", "configmaps"), ("", "v1", "services"), ("apps", "v1", "deployments")]
CHILD_RESOURCES += [("policy", "v1", "poddisruptionbudgets")]

RECONCILES = Counter("overlap_operator_reconciles_total", "InferenceService reconciles", ["outcome"])
CHILD_WRITES = Counter(
    "overlap_operator_child_writes_total", "Children created, updated, put back or deleted", ["kind", "outcome"]
)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ours = settings_of(memo)
    kube.configure(ours.api_timeout_s)
    # Keep kopf's bookkeeping in overlap.dev annotations: the CRD's status schema has no room for kopf's own.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="overlap.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="overlap.dev", key="last-handled-configuration"
    )
    settings.persistence.finalizer = "overlap.dev/finalizer"
    settings.posting.reporting_component = "overlap-operator"
    settings.posting.level = logging.INFO
    # Events are what the operator posts itself (kopf.info / kopf.warn: a child written, a decision); its log lines
    # are not, or a stopped Prometheus posts a Warning every tick and each child write is posted twice. kopf posts
    # log lines only when asked since 1.41 (the minimum in pyproject.toml); said here so that it stays so.
    settings.posting.loggers = False
    # The CRDs are installed before the operator (the chart does it): no need to watch for new ones.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # kopf's own requests (finalizers, progress annotations, events) give up like the operator's (--api-timeout-s)
    settings.networking.connect_timeout, settings.networking.request_timeout = kube.request_timeout()
    # The API server filters the children's watches by our label: the operator lists and watches only what it
    # owns, not every ConfigMap, Service, Deployment, PDB and Pod in the cluster.
    owned = ",".join(f"{key}={value}" for key, value in sorted(OWNED.items()))
    for resource in [*CHILD_RESOURCES, ("", "v1", "pods")]:
        settings.watching.label_selectors[resource] = owned


def _reconcile_children(
    body: Mapping[str, Any], logger: logging.Logger, model_image: str | None, patched_means: str = "updated"
) -> None:
    """Plan what the spec asks for, then apply it; an invalid spec sets Degraded and changes nothing. The plan is made
    from the service as read under its lock: `body` may predate a control tick's retune (status.liveKnobs), which a
    plan from it would write back."""
    meta = body["metadata"]
    with service_lock(meta["uid"]):
        fresh = kube.read_service(meta["name"], meta["namespace"])
        if fresh is None or fresh["metadata"].get("uid") != meta["uid"]:
            return  # deleted meanwhile: nothing to reconcile
        _plan_and_apply(fresh, logger, model_image, patched_means)


def _plan_and_apply(
    body: Mapping[str, Any], logger: logging.Logger, model_image: str | None, patched_means: str
) -> None:
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    try:
        monitors = "monitoring.coreos.com" in kube.api_groups()
        plan = plans.desired(body, with_servicemonitor=monitors, model_image=model_image)
    except specs.SpecError as exc:
        problem = f"invalid spec, nothing changed: {exc}"
        kube.patch_status(name, namespace, lambda current: status.degraded_status(current, problem, status.now_iso()))
        kopf.warn(dict(body), reason="InvalidSpec", message=problem)
        RECONCILES.labels("invalid_spec").inc()
        raise kopf.PermanentError(problem) from exc
    plans.apply(plan, body, _reporter(body, logger), patched_means)
    RECONCILES.labels("applied").inc()


def _reporter(owner: Mapping[str, Any], logger: logging.Logger) -> plans.Report:
    """Each change `apply` made: a metric, a log line and an Event on the service."""

    def report(kind: str, name: str, outcome: str, why: str | None) -> None:
        CHILD_WRITES.labels(kind, outcome).inc()
        message = f"{kind} {name} {outcome}" + (f": {why}" if why else "")
        logger.info(message)
        kopf.info(dict(owner), reason=outcome.capitalize(), message=message)

    return report


@kopf.on.resume(*CR)
@kopf.on.create(*CR)
@kopf.on.update(*CR)
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, retry: int, **_: Any) -> None:
    kube.HANDLER_RETRY.set(retry)
    _reconcile_children(body, logger, settings_of(memo).model_image)
    adapter_sync.sync_service_soon(body)  # an adapter removed from the list goes at once; a new one loads once fetched


def _owner_of(child: Mapping[str, Any]) -> dict[str, Any] | None:
    """The live InferenceService that owns `child`, or None (gone, being deleted, or not ours)."""
    meta = child["metadata"]
    refs = [r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND and r.get("controller")]
    if not refs:
        return None
    owner = kube.read_service(refs[0]["name"], meta["namespace"])
    if owner is None or owner["metadata"].get("uid") != refs[0]["uid"] or owner["metadata"].get("deletionTimestamp"):
        return None
    return owner


def _restore(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger, model_image: str | None) -> None:
    owner = _owner_of(body)
    if owner is None:
        return
    kind, name = body["kind"], body["metadata"]["name"]
    if event.get("type") != "DELETED":
        # Cheap pre-check: most events are our own writes or the controller's status updates.
        try:
            plan = plans.desired(owner, with_servicemonitor=False, model_image=model_image)
        except specs.SpecError:
            return  # reconcile reports it as Degraded
        wanted = [c for c in plan.children if c["kind"] == kind and c["metadata"]["name"] == name]
        if all(is_subset(c, dict(body)) for c in wanted):
            return
    logger.info(f"{kind} {name} was {'deleted' if event.get('type') == 'DELETED' else 'changed'} by hand; restoring")
    _reconcile_children(owner, logger, model_image, patched_means="restored")


def restore_child(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    _restore(event, body, logger, settings_of(memo).model_image)


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels=OWNED, id=f"restore-{_plural}")(restore_child)


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Every service's children put right every --resync-s, whatever its autoscaling mode. The event handlers
    above restore a child when its change is seen, but kopf does not retry them, and an event lost in a watch gap
    (the history compacted while the watch was down) is never seen. A task of the operator's, not a kopf timer: a
    timer would put kopf's finalizer on every service."""
    settings = settings_of(memo)
    memo.resync_task = asyncio.create_task(_resync_forever(settings, logger))  # inherits kopf's context (events)


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
    adapter_sync.stop_retries()  # the passes planned for adapters still being fetched


async def _resync_forever(settings: OperatorSettings, logger: logging.Logger) -> None:
    while True:
        await asyncio.sleep(settings.resync_s)
        try:
            await asyncio.to_thread(resync_all, settings, logger)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:  # the list failed: the next round tries again
            logger.warning(f"resync: {exc}")


def resync_all(settings: OperatorSettings, logger: logging.Logger) -> int:
    """One round: each watched service's plan applied (only what differs is written), and the status of one whose
    model is fetched brought up to date (its progress); returns how many were put right. A service whose writes
    fail (RBAC, a conflict) is logged and does not hold up the others."""
    namespaces = settings.namespaces
    services = [s for n in namespaces for s in kube.list_services(n)] if namespaces else kube.list_all_services()
    monitors = "monitoring.coreos.com" in kube.api_groups()
    done = 0
    for listed in services:
        meta = listed["metadata"]
        try:
            with service_lock(meta["uid"]):
                body = kube.read_service(meta["name"], meta["namespace"])  # as it is now, not as listed
                if body is None or body["metadata"].get("deletionTimestamp"):
                    continue
                plan = plans.desired(body, with_servicemonitor=monitors, model_image=settings.model_image)
                plans.apply(plan, body, _reporter(body, logger), "restored")
                # a long fetch moves no pod event: its progress is read here
                if specs.fetch_subject(body["spec"]):
                    _mirror(body, kube.read("Deployment", meta["name"], meta["namespace"]))
            adapter_sync.sync_service_soon(body)  # the adapters fetched since the last pass are loaded
            done += 1
        except specs.SpecError:
            pass  # reconcile set Degraded when the spec was written
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            logger.warning(f"resync of {meta['namespace']}/{meta['name']}: {exc}")
    return done


def _ensure_admin_token(owner: Mapping[str, Any]) -> None:
    if admin_tokens.ensure(owner)[1]:
        message = f"Secret {admin_tokens.SECRET} (admin tokens of the namespace's services)"
        kopf.info(dict(owner), reason="Created", message=message)


def _mirror(owner: Mapping[str, Any], deployment: Mapping[str, Any] | None) -> None:
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    pods = kube.list_pods(namespace, selector_string(name))
    problems = status.pod_problems(pods)
    when, model = status.now_iso(), None
    fetched = specs.fetch_subject(owner.get("spec") or {})  # the model, its draft, or both: one fetch container
    if fetched:
        generation = (owner.get("status") or {}).get("observedGeneration")
        # only the pods fetching what the spec names now: during a rollout to another uri the old pods have the last
        fetching = status.pods_running(pods, FETCH_CONTAINER, fetch_args(specs.with_defaults(owner["spec"])) or [])
        model = status.model_condition(fetching, FETCH_CONTAINER, fetched, when, generation, _fetch_progress(fetching))
    kube.patch_status(
        name, namespace, lambda current: status.rollout_status(current, deployment, when, problems, model)
    )


def _fetch_progress(pods: list[dict[str, Any]]) -> dict[str, str]:
    """The last progress line of each pod's running fetch (its log's tail, as `kubectl logs -c fetch` shows)."""
    lines = {}
    for pod in pods:
        if "running" in (status.init_container(pod, FETCH_CONTAINER).get("state") or {}):
            line = kube.log_tail(pod["metadata"]["name"], pod["metadata"]["namespace"], FETCH_CONTAINER)
            if line:
                lines[pod["metadata"]["name"]] = line
    return lines


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
def mirror_rollout(body: kopf.Body, type: str | None, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    if type == "DELETED":
        return  # restore_child recreates it; the new one's events update the status
    owner = _owner_of(body)
    if owner is None or body["metadata"]["name"] != owner["metadata"]["name"]:
        return  # not the engine Deployment (the activator's and router's have no status to mirror)
    _mirror(owner, dict(body))
    _route(owner, dict(body), logger, settings_of(memo).model_image)


def _route(
    owner: Mapping[str, Any], deployment: Mapping[str, Any], logger: logging.Logger, model_image: str | None
) -> None:
    """For a service that scales to zero: point its Service at the pods once one is ready, at the activator while
    none is (the first ready pod takes the traffic at once, without waiting for a reconcile)."""
    spec = specs.with_defaults(owner.get("spec") or {}, model_image)
    if not children.has_activator(spec):
        return
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    ready = (deployment.get("status") or {}).get("readyReplicas") or 0
    to_activator = children.at_zero(spec, ready)
    service = children.adopt(children.build_service(name, namespace, spec, to_activator=to_activator), owner)
    if kube.apply(service) != "unchanged":
        where = "the activator (no ready replica)" if to_activator else f"the pods ({ready} ready)"
        logger.info(f"Service {name} routes to {where}")
        kopf.info(dict(owner), reason="Routed", message=f"Service {name} routes to {where}")


@kopf.on.event("", "v1", "pods", labels=OWNED)
def mirror_pods(body: kopf.Body, **_: Any) -> None:
    """A pod's trouble (ErrImagePull, CrashLoopBackOff, failing probes) reaches the Ready condition's message, even
    when the Deployment's counts do not move."""
    name = (body["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
    namespace = body["metadata"]["namespace"]
    owner = kube.read_service(name, namespace) if name else None
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    if not status.pod_is_ready(body):
        # A starting pod mounts its admin token: a deleted Secret (a rotation) is written anew before it waits.
        _ensure_admin_token(owner)
    _mirror(owner, kube.read("Deployment", name, namespace))
    if status.pod_is_ready(body):  # a pod that became ready gets the adapters at once
        adapter_sync.sync_service_soon(owner)


@kopf.on.delete(*CR, optional=True)
def announce_deletion(name: str, namespace: str, uid: str, logger: logging.Logger, **_: Any) -> None:
    # optional=True: no finalizer; owner references let the garbage collector remove the children.
    adapter_sync.forget(uid)  # a pass planned for an adapter still being fetched
    logger.info(f"InferenceService {namespace}/{name} deleted; its children go with the garbage collector")
