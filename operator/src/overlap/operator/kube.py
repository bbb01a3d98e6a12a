"""The operator's only door to the Kubernetes API (the `kubernetes` client), with its errors made kopf-shaped.

Transient failures (5xx, 429, 409 conflicts, a dropped connection) raise `kopf.TemporaryError(delay=)` so kopf
retries the handler; other refusals raise `kopf.PermanentError` with the server's message.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import kopf
import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from overlap.operator import status
from overlap.operator.drift import is_subset
from overlap.operator.identity import GROUP, PLURAL, VERSION
from overlap.operator.settings import DEFAULT_API_TIMEOUT_S

RETRY_DELAY_S = 2.0
MAX_RETRY_DELAY_S = 60.0
# Every API request gives up after this long (a hung API server or a dropped connection would otherwise hold a
# handler forever) and is retried like any transient failure; `configure` sets it (the operator's --api-timeout-s).
_api_timeout_s = DEFAULT_API_TIMEOUT_S


def api_timeout_s() -> float:
    return _api_timeout_s


def request_timeout() -> tuple[float, float]:
    """The kubernetes client's `_request_timeout`: (connect, read) seconds."""
    total = api_timeout_s()
    return min(5.0, total), total


MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "overlap-operator"
log = logging.getLogger(__name__)

# kind -> (API class, method suffix) for the typed client.
_TYPED = {
    "ConfigMap": (kubernetes.client.CoreV1Api, "namespaced_config_map"),
    "Secret": (kubernetes.client.CoreV1Api, "namespaced_secret"),
    "Service": (kubernetes.client.CoreV1Api, "namespaced_service"),
    "Deployment": (kubernetes.client.AppsV1Api, "namespaced_deployment"),
    "PodDisruptionBudget": (kubernetes.client.PolicyV1Api, "namespaced_pod_disruption_budget"),
}
_CUSTOM = {"ServiceMonitor": ("monitoring.coreos.com", "v1", "servicemonitors")}


def configure(api_timeout_s: float = DEFAULT_API_TIMEOUT_S) -> None:
    """Once at start: the credentials (in a pod: the service account; elsewhere: the kubeconfig, $KUBECONFIG or
    ~/.kube/config), and how long an API request may take (OperatorSettings.api_timeout_s)."""
    global _api_timeout_s
    _api_timeout_s = api_timeout_s
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


@contextlib.contextmanager
def api_errors(what: str) -> Iterator[None]:
    try:
        yield
    except ApiException as exc:
        message = _server_message(exc)
        # 403: RBAC may be fixed (a chart upgrade) without the spec changing; 409, 429 and 5xx pass by themselves.
        if exc.status in (403, 409, 429) or exc.status >= 500:
            delay = retry_delay()
            raise kopf.TemporaryError(f"{what}: {exc.status} {message}; retrying in {delay:g} s", delay=delay) from exc
        raise kopf.PermanentError(f"{what}: {exc.status} {message}") from exc
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        delay = retry_delay()
        raise kopf.TemporaryError(f"{what}: {exc}; retrying in {delay:g} s", delay=delay) from exc


# The handler's retry count (kopf's `retry` kwarg), set by handlers that retry, for the back-off of api_errors.
HANDLER_RETRY: contextvars.ContextVar[int] = contextvars.ContextVar("handler_retry", default=0)


def retry_delay() -> float:
    """Exponential back-off: 2 s, 4 s, 8 s ... capped at a minute."""
    return min(RETRY_DELAY_S * 2 ** HANDLER_RETRY.get(), MAX_RETRY_DELAY_S)


def _server_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def _calls(kind: str) -> tuple[Callable, Callable, Callable, Callable]:
    """(read, create, patch, delete) for `kind`: read and delete take (name, namespace), create (namespace, body),
    patch (name, namespace, body, content type, query options); read and patch return the object as JSON."""
    if kind in _TYPED:
        api_class, suffix = _TYPED[kind]
        api = api_class()
        # Raw JSON (camelCase, as the server sends it), not the typed models: that is what drift checks compare.
        return (
            lambda name, ns: json.loads(
                getattr(api, f"read_{suffix}")(
                    name, ns, _preload_content=False, _request_timeout=request_timeout()
                ).data
            ),
            lambda ns, body: getattr(api, f"create_{suffix}")(ns, body, _request_timeout=request_timeout()),
            lambda name, ns, body, content_type, **options: json.loads(
                getattr(api, f"patch_{suffix}")(
                    name,
                    ns,
                    body,
                    _content_type=content_type,
                    _preload_content=False,
                    _request_timeout=request_timeout(),
                    **options,
                ).data
            ),
            lambda name, ns: getattr(api, f"delete_{suffix}")(name, ns, _request_timeout=request_timeout()),
        )
    group, version, plural = _CUSTOM[kind]
    api = kubernetes.client.CustomObjectsApi()
    return (
        lambda name, ns: api.get_namespaced_custom_object(
            group, version, ns, plural, name, _request_timeout=request_timeout()
        ),
        lambda ns, body: api.create_namespaced_custom_object(
            group, version, ns, plural, body, _request_timeout=request_timeout()
        ),
        lambda name, ns, body, content_type, **options: api.patch_namespaced_custom_object(
            group,
            version,
            ns,
            plural,
            name,
            body,
            _content_type=content_type,
            _request_timeout=request_timeout(),
            **options,
        ),
        lambda name, ns: api.delete_namespaced_custom_object(
            group, version, ns, plural, name, _request_timeout=request_timeout()
        ),
    )


def read(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    read_fn = _calls(kind)[0]
    with api_errors(f"reading {kind} {namespace}/{name}"):
        try:
            obj = read_fn(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
    return obj


def apply(desired: Mapping[str, Any]) -> str:
    """Make the live object match `desired`: 'created', 'patched' (it differed) or 'unchanged'.

    Server-side apply as the operator's field manager, forcing conflicts: fields the spec no longer sets (a
    removed nodeSelector, toleration, pull secret) leave the object. Apply keeps what other writers add to a list,
    so when an entry was added to one of the operator's lists (a port on the Service, an env entry), a merge patch
    then replaces those lists whole: the admin port never stays on a Service.
    """
    kind, meta = desired["kind"], desired["metadata"]
    patch_fn = _calls(kind)[2]
    actual = read(kind, meta["name"], meta["namespace"])
    with api_errors(f"applying {kind} {meta['namespace']}/{meta['name']}"):
        result = patch_fn(meta["name"], meta["namespace"], dict(desired), APPLY_PATCH,
                          field_manager=FIELD_MANAGER, force=True)  # fmt: skip
        if not is_subset(desired, result):
            result = patch_fn(meta["name"], meta["namespace"], dict(desired), MERGE_PATCH, field_manager=FIELD_MANAGER)
    if actual is None:
        return "created"
    return "unchanged" if result["metadata"]["resourceVersion"] == actual["metadata"]["resourceVersion"] else "patched"


def delete_if_owned(kind: str, name: str, namespace: str, owner_uid: str) -> bool:
    """Delete a child the spec no longer wants (a disabled ServiceMonitor), if it exists and `owner_uid` owns it."""
    actual = read(kind, name, namespace)
    refs = (actual or {}).get("metadata", {}).get("ownerReferences") or []
    if not any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs):
        return False
    with api_errors(f"deleting {kind} {namespace}/{name}"):
        try:
            _calls(kind)[3](name, namespace)
        except ApiException as exc:
            if exc.status == 404:  # gone meanwhile
                return False
            raise
    return True


def json_patch(kind: str, name: str, namespace: str, operations: list[dict[str, Any]]) -> dict[str, Any]:
    with api_errors(f"patching {kind} {namespace}/{name}"):
        return _calls(kind)[2](name, namespace, operations, JSON_PATCH, field_manager=FIELD_MANAGER)


def create_if_absent(desired: Mapping[str, Any]) -> bool:
    """Create `desired` unless an object of that name exists (it is then left as it is)."""
    kind, meta = desired["kind"], desired["metadata"]
    create_fn = _calls(kind)[1]
    with api_errors(f"creating {kind} {meta['namespace']}/{meta['name']}"):
        try:
            create_fn(meta["namespace"], dict(desired))
        except ApiException as exc:
            if exc.status == 409:  # created meanwhile: fine
                return False
            raise
    return True


def read_service(name: str, namespace: str) -> dict[str, Any] | None:
    """The InferenceService as JSON, or None when it does not exist."""
    api = kubernetes.client.CustomObjectsApi()
    with api_errors(f"reading InferenceService {namespace}/{name}"):
        try:
            return api.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=request_timeout()
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


def list_services(namespace: str) -> list[dict[str, Any]]:
    """Every InferenceService in the namespace, as JSON."""
    api = kubernetes.client.CustomObjectsApi()
    with api_errors(f"listing InferenceServices in {namespace}"):
        found = api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _request_timeout=request_timeout())
    return found.get("items") or []


def list_all_services() -> list[dict[str, Any]]:
    """Every InferenceService in the cluster, as JSON."""
    api = kubernetes.client.CustomObjectsApi()
    with api_errors("listing InferenceServices"):
        found = api.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=request_timeout())
    return found.get("items") or []


def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    api = kubernetes.client.CoreV1Api()
    with api_errors(f"listing pods {selector} in {namespace}"):
        pods = json.loads(
            api.list_namespaced_pod(
                namespace, label_selector=selector, _preload_content=False, _request_timeout=request_timeout()
            ).data
        )
    return pods.get("items") or []


def log_tail(pod: str, namespace: str, container: str, lines: int = 1) -> str | None:
    """The last `lines` lines a container logged (None if it cannot be read: a progress line is not worth an
    error)."""
    api = kubernetes.client.CoreV1Api()
    try:
        text = api.read_namespaced_pod_log(
            pod, namespace, container=container, tail_lines=lines, _preload_content=False,
            _request_timeout=request_timeout(),
        ).data.decode(errors="replace")  # fmt: skip
    except (ApiException, OSError, urllib3.exceptions.HTTPError):
        return None
    return "\n".join(text.strip().splitlines()[-lines:]) if text.strip() else None


def ready_pod_ips(namespace: str, selector: str) -> list[str]:
    """The IPs of the Ready pods matching a label selector (the control loop talks to their admin ports)."""
    ips = []
    for pod in list_pods(namespace, selector):
        pod_ip = (pod.get("status") or {}).get("podIP")
        if status.pod_is_ready(pod) and pod_ip and not pod["metadata"].get("deletionTimestamp"):
            ips.append(pod_ip)
    return ips


def scale(name: str, namespace: str, replicas: int) -> None:
    """Set an InferenceService's spec.replicas (the control loop's move; the reconcile rolls it out)."""
    api = kubernetes.client.CustomObjectsApi()
    with api_errors(f"scaling InferenceService {namespace}/{name}"):
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}},
                                           _content_type=MERGE_PATCH, _request_timeout=request_timeout())  # fmt: skip


def serves_inference_services() -> bool:
    """Whether the API server serves the InferenceService resource (its CRD is installed and established), by API
    discovery, which every authenticated client may read."""
    try:
        resources = kubernetes.client.CustomObjectsApi().get_api_resources(
            GROUP, VERSION, _request_timeout=request_timeout()
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return any(resource.name == PLURAL for resource in resources.resources)


def api_groups() -> set[str]:
    with api_errors("API discovery"):
        return {group.name for group in kubernetes.client.ApisApi().get_api_versions().groups}


def patch_status(name: str, namespace: str, compute: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Read the InferenceService, `compute` its new status from it, write it with optimistic concurrency.

    Several handlers write status; the resourceVersion in the patch makes the server refuse a stale write (409),
    and then this reads again and recomputes (a few times) instead of losing the other writer's update.
    """
    api = kubernetes.client.CustomObjectsApi()
    args = (GROUP, VERSION, namespace, PLURAL, name)
    for attempt in range(5):
        with api_errors(f"reading InferenceService {namespace}/{name}"):
            try:
                current = api.get_namespaced_custom_object(*args, _request_timeout=request_timeout())
            except ApiException as exc:
                if exc.status == 404:
                    return  # deleted meanwhile: nothing to report on
                raise
        status = compute(current)
        if status is None or all((current.get("status") or {}).get(k) == v for k, v in status.items()):
            return
        body = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}, "status": status}
        try:
            api.patch_namespaced_custom_object_status(
                *args, body, _content_type=MERGE_PATCH, _request_timeout=request_timeout()
            )
            return
        except ApiException as exc:
            if exc.status != 409 or attempt == 4:
                with api_errors(f"writing the status of {namespace}/{name}"):
                    raise
            log.debug("status of %s/%s changed meanwhile; recomputing", namespace, name)
