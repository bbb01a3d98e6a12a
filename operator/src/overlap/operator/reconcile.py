"""An InferenceService's reconcile in two steps: `desired(service) -> Plan`, pure (the children its spec asks for,
the children it no longer wants, how its status is computed), then `apply(plan)`, where every write goes through
`kube`. The kopf handlers (handlers.py) call them and turn what changed into Events and metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from overlap.engine.config import EngineConfig
from overlap.operator import adapters, admin_tokens, children, kube, status
from overlap.operator import spec as specs
from overlap.operator.identity import (
    activator_name,
    pods_service_name,
    replicas_service_name,
    router_name,
    selector_string,
)

# What `apply` reports: (kind, name, outcome, why), outcome one of created / updated / restored / deleted.
Report = Callable[[str, str, str, str | None], None]


@dataclass(slots=True)
class Plan:
    name: str
    namespace: str
    uid: str
    spec: dict[str, Any]  # with the CRD's defaults filled in
    config: EngineConfig  # with the knobs the tuner owns
    children: list[dict[str, Any]]  # each with its owner reference
    unwanted: list[tuple[str, str, str]]  # (kind, name, why) of children the spec no longer wants

    @property
    def selector(self) -> str:
        return selector_string(self.name)

    def status(self, current: Mapping[str, Any], deployment: Mapping[str, Any] | None, problems: list[str],
               when: str) -> dict[str, Any]:  # fmt: skip
        """The service's new status, from the current one and the engine Deployment and pods as they are."""
        url = children.service_url(self.name, self.namespace, self.spec)
        return status.service_status(current, deployment, self.config.live, selector=self.selector, url=url,
                                     when=when, problems=problems)  # fmt: skip


def desired(service: Mapping[str, Any], *, with_servicemonitor: bool, model_image: str | None = None) -> Plan:
    """What the service's spec asks for; SpecError (with the fix in its message) when it cannot be served.
    `model_image`: the operator's image for a service that names none (see `spec.with_defaults`)."""
    meta = service["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    spec = specs.with_defaults(service.get("spec") or {}, model_image)
    specs.check_name(name)
    config = specs.tuned_config(specs.check_spec(spec), spec, service.get("status"))
    adapters.check(spec)
    built = children.build_children(service, spec, config, with_servicemonitor=with_servicemonitor)
    unwanted: list[tuple[str, str, str]] = []
    if with_servicemonitor and not spec["prometheus"]["serviceMonitor"]["enabled"]:
        unwanted.append(("ServiceMonitor", name, "spec.prometheus.serviceMonitor.enabled is false"))
    if not children.has_activator(spec):  # the scale-to-zero activator comes and goes with minReplicas 0
        why = "the router holds requests at zero" if children.routed(spec) else "the service no longer scales to zero"
        unwanted += [("Deployment", activator_name(name), why), ("Service", pods_service_name(name), why)]
    if not spec.get("adapters"):
        unwanted.append(("ConfigMap", adapters.configmap_name(name), "spec.adapters lists none"))
    if not children.routed(spec):
        why = "spec.routing.mode is not prefix"
        unwanted += [("Deployment", router_name(name), why), ("Service", replicas_service_name(name), why)]
    return Plan(name, namespace, meta["uid"], spec, config, built, unwanted)


def _routed(plan: Plan, service: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The plan's children, the public Service of a service that scales to zero routed by the engine Deployment as
    it is now (as handlers._route does on its events), not by the readyReplicas last mirrored into the status: that
    can lag a pod that just became ready, and a reconcile on it would point the Service back at the activator with
    no Deployment event left to undo it."""
    if not children.has_activator(plan.spec):
        return plan.children
    deployment = kube.read("Deployment", plan.name, plan.namespace)
    ready = ((deployment or {}).get("status") or {}).get("readyReplicas") or 0
    to_activator = children.at_zero(plan.spec, ready)
    public = children.adopt(children.build_service(plan.name, plan.namespace, plan.spec, to_activator), service)
    return [public if (c["kind"], c["metadata"]["name"]) == ("Service", plan.name) else c for c in plan.children]


def apply(plan: Plan, service: Mapping[str, Any], report: Report, patched_means: str = "updated") -> None:
    """Make the cluster match the plan: the admin token, every child, the unwanted ones gone, then the status. A
    child that differed is `patched_means` ('updated' when the spec changed, 'restored' when a hand edit or
    deletion is undone). A refused write leaves its reason in the status and raises for kopf to retry."""
    if admin_tokens.ensure(service)[1]:
        report("Secret", admin_tokens.SECRET, "created", "admin tokens of the namespace's services")
    for child in _routed(plan, service):
        kind, child_name = child["kind"], child["metadata"]["name"]
        try:
            outcome = kube.apply(child)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            # The API server's own words in the status, while kopf retries (or gives up on a permanent error).
            problem = f"{kind} {child_name} not applied: {exc}"

            def degraded(current, problem=problem):
                return status.degraded_status(current, problem, status.now_iso(), "ApplyFailed")

            kube.patch_status(plan.name, plan.namespace, degraded)
            raise
        if outcome != "unchanged":
            report(kind, child_name, patched_means if outcome == "patched" else outcome, None)
    for kind, child_name, why in plan.unwanted:
        if kube.delete_if_owned(kind, child_name, plan.namespace, plan.uid):
            report(kind, child_name, "deleted", why)
    deployment = kube.read("Deployment", plan.name, plan.namespace)
    problems = status.pod_problems(kube.list_pods(plan.namespace, plan.selector))
    kube.patch_status(plan.name, plan.namespace,
                      lambda current: plan.status(current, deployment, problems, status.now_iso()))  # fmt: skip
