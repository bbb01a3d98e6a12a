"""A Kubernetes API for the tests: kmock's KubernetesEmulator plus what real API servers do and kmock 0.8 does not.

kmock parses the URLs, serves discovery and reads, and renders errors. This subclass adds, and says so:

| gap in kmock 0.8                                   | done here                                            |
|----------------------------------------------------|------------------------------------------------------|
| a trailing slash 404s; POST answers 200            | slash stripped; 201 on create                        |
| `GET /api/v1/namespaces` 500s; core says "/v1"     | namespaces served from the objects; groupVersion v1  |
| creating a CRD does not register its kind          | registered (kind, scope, short names, subresources)  |
| no uid / resourceVersion / generation / timestamps | set on every write; generation follows the spec      |
| no conflicts, no JSON patch (kopf's `test` op)     | 409 on a stale resourceVersion; RFC 6902 via jsonpatch |
| status is not a subresource, no /scale             | /status writes only status, the main path never does; /scale |
| lists lack kind; selectors ignored                 | kind + resourceVersion; label and field selectors    |
| watches: resourceVersion, timeoutSeconds ignored,  | a replayable event log; timeouts end the stream;     |
|   octet-stream content type, no sendInitialEvents  |   application/json; the initial-events-end bookmark; |
|   no 410 Expired, streams never cut                |   compaction (410 Expired); streams cut on demand    |
| no CRD validation, no server-side printing         | defaulting + schema + CEL (admission.py); Tables    |
| no OpenAPI: kubectl apply wants --validate=false   | /openapi/v3 says "fieldValidation supported", no more |
| no garbage collector                               | owner references followed on delete (background)     |
| no managed fields, no server-side apply            | managedFields on every write; apply (apply.py)       |

Strategic merge patches are applied as JSON merge patches (lists replaced, `$` directives dropped): enough for
`kubectl apply` of new objects and for the status writes of kopf and the operator. Not an API server: no RBAC,
no admission webhooks, no pods, no controllers (the node agent or the tests play them).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import rendering  # Response with headers, for the watch stream's content type

from tests.support.kube.admission import admit_crd, admit_custom_resource
from tests.support.kube.apply import APPLY_PATCH, manager_of, record_update, server_side_apply
from tests.support.kube.selectors import jsonpath, match_fields, match_labels
from tests.support.kube.status import api_status
from tests.support.kube.watches import WATCH_END, watch_events

R = kmock.resource
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

# Built-in kinds the operator, kubectl and kopf touch: (group, version, plural, kind, namespaced, subresources,
# short names).
BUILTINS = [
    ("", "v1", "namespaces", "Namespace", False, (), ("ns",)),
    ("", "v1", "configmaps", "ConfigMap", True, (), ("cm",)),
    ("", "v1", "secrets", "Secret", True, (), ()),
    ("", "v1", "services", "Service", True, ("status",), ("svc",)),
    ("", "v1", "serviceaccounts", "ServiceAccount", True, (), ("sa",)),
    ("", "v1", "events", "Event", True, (), ("ev",)),
    ("events.k8s.io", "v1", "events", "Event", True, (), ()),
    ("apps", "v1", "deployments", "Deployment", True, ("status", "scale"), ("deploy",)),
    ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False, ("status",), ()),
    ("", "v1", "pods", "Pod", True, ("status", "log"), ("po",)),
    ("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("status",), ("pvc",)),
    ("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", True, ("status",), ("hpa",)),
    ("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False, (), ()),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False, (), ()),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role", True, (), ()),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True, (), ()),
]  # fmt: skip


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str) -> str:
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m" if seconds < 7200 else f"{seconds // 3600}h"


def _targets(path: str, plural: str, name: str | None) -> bool:
    """Whether a request path is on `plural` (and on the object `name`, where given), for the injected faults."""
    return f"/{plural}" in path if name is None else path.endswith(f"/{plural}/{name}")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; keys starting with `$` (strategic-merge directives) are dropped."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class ApiServer(kmock.KubernetesEmulator):
    """The emulator with a real server's write semantics (see the module docstring)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.crds: dict[Any, dict] = {}  # resource -> the CRD version's schema/printer columns/scale paths
        self.infos: dict[Any, tuple[str, bool, tuple]] = {}  # resource -> (kind, namespaced, subresources)
        self.pod_logs: Callable[[str, str | None], str] | None = None  # (pod, container) -> its log: a kubelet
        self.rv = itertools.count(1000)
        self.last_rv = 1000
        self.events: list[tuple[int, Any, dict]] = []  # (resourceVersion, resource, watch event): replayable
        self.added_at: dict[tuple[str, str | None, str], float] = {}  # (kind, namespace, name) -> monotonic time
        self.watchers: set[asyncio.Queue] = set()
        self.compacted_rv = 0  # watches resuming from before this get 410 Expired (etcd compacted the history)
        self.failures: list[list] = []  # [method, plural, status, times] injected by tests
        self.hangs: list[list] = []  # [method, plural, seconds]: the next such request is held that long
        self.lost: list[list] = []  # [event type, plural]: the next such watch event never reaches a watcher
        self.request_log: list[rendering.Request] = []  # every request answered, in order (for the tests' checks)
        # Applies that created their object (RBAC authorizes them as create too), by id(): the request stays here,
        # so its id is never reused.
        self.applies_that_created: dict[int, rendering.Request] = {}
        self.failures_lock = threading.Lock()
        self.validate_custom_resources = True  # False: a server without CRD validation (to test the operator's)
        for group, version, plural, kind, namespaced, subresources, short in BUILTINS:
            self._register(R(group, version, plural), kind, namespaced, subresources, short)

    def _register(self, resource, kind: str, namespaced: bool, subresources=(), short=(), categories=()) -> None:
        self.resources[resource] = kmock.ResourceInfo(
            kind=kind,
            singular=kind.lower(),
            namespaced=namespaced,
            verbs=VERBS,
            shortnames=list(short),
            categories=list(categories),
            subresources=list(subresources),
        )
        self.infos[resource] = (kind, namespaced, tuple(subresources))

    def end_watches(self, loop: asyncio.AbstractEventLoop) -> int:
        """End every open watch stream now, as a restarting API server or a proxy's idle timeout does; returns how
        many. `loop` is the server's (this is called from the tests' thread)."""
        queues = list(self.watchers)
        for queue in queues:
            loop.call_soon_threadsafe(queue.put_nowait, WATCH_END)
        return len(queues)

    def compact(self) -> None:
        """Forget the event history so far, as etcd's compaction does: a watch that resumes from an earlier
        resourceVersion is told 410 Expired and must list again."""
        self.compacted_rv = self.last_rv + 1
        self.events.clear()

    def hang_next(self, method: str, plural: str, seconds: float, name: str | None = None) -> None:
        """Hold the next request of `method` on `plural` (on the object `name` only, where given: another object's
        reconcile may write first) for `seconds`, then serve it (a client that timed out meanwhile retries a write
        that happened: the retry must be idempotent)."""
        with self.failures_lock:
            self.hangs.append([method.upper(), plural, seconds, name])

    def lose_next_event(self, event_type: str, plural: str) -> None:
        """The next `event_type` (ADDED, MODIFIED, DELETED) watch event on `plural` reaches no watcher, now or on a
        resumed watch: what a watcher sees of a change made while its watch was down and the history since compacted
        (a list shows the state after it, and no event says what happened)."""
        with self.failures_lock:
            self.lost.append([event_type, plural])

    def fail_next(self, method: str, plural: str, status: int, times: int = 1, name: str | None = None) -> None:
        """Answer the next `times` requests of `method` on `plural` (on the object `name` only, where given) with
        `status` (to test retries)."""
        with self.failures_lock:
            self.failures.append([method.upper(), plural, status, times, name])

    # --- HTTP-level fixes -------------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path != "/" and raw_request.path.endswith("/"):
            raw_request = raw_request.clone(rel_url=raw_request.rel_url.with_path(raw_request.path.rstrip("/")))
        if m := re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?", raw_request.path):
            return self._namespaces(m[1])
        if m := re.fullmatch(r"/openapi/v3(?:/(.+))?", raw_request.path):
            return self._openapi_v3(m[1])
        injected = self._injected(raw_request)
        if injected is not None:
            return injected
        hang = self._hang_for(raw_request)
        if hang:
            await asyncio.sleep(hang)
        response = await super().__call__(raw_request)
        if raw_request.method == "POST" and response.status == 200 and not response.prepared:
            response.setapi_status(201)
        return response

    def _hang_for(self, raw_request: aiohttp.web.BaseRequest) -> float:
        with self.failures_lock:
            for hang in self.hangs:
                method, plural, seconds, name = hang
                if raw_request.method == method and _targets(raw_request.path, plural, name):
                    self.hangs.remove(hang)
                    return seconds
        return 0.0

    def _injected(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.Response | None:
        with self.failures_lock:
            for failure in self.failures:
                method, plural, status, times, name = failure
                if raw_request.method == method and _targets(raw_request.path, plural, name) and times > 0:
                    failure[3] -= 1
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                            "reason": "ServiceUnavailable", "message": "injected by the test"}  # fmt: skip
                    return aiohttp.web.json_response(body, status=status)
        return None

    def _namespaces(self, name: str | None) -> aiohttp.web.Response:
        names = sorted({ns for (_, ns, _) in self.objects if ns} | {"default", "kube-system"})

        def namespace(ns: str) -> dict:
            return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}, "status": {"phase": "Active"}}

        if name is None:
            items = [namespace(ns) for ns in names]
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList", "items": items,
                                              "metadata": {"resourceVersion": str(self.last_rv)}})  # fmt: skip
        return aiohttp.web.json_response(namespace(name))

    def _openapi_v3(self, group_version: str | None) -> aiohttp.web.Response:
        """Just enough OpenAPI v3 for kubectl to see that the server validates fields itself (fieldValidation):
        then `kubectl apply` sends `?fieldValidation=Strict` instead of validating against schemas it lacks."""

        def gv_path(res) -> str:
            return f"api/{res.version}" if res.group == "" else f"apis/{res.group}/{res.version}"

        if group_version is None:
            paths = {gv_path(res): {"serverRelativeURL": f"/openapi/v3/{gv_path(res)}"} for res in self.infos}
            return aiohttp.web.json_response({"paths": paths})
        paths = {}
        for res, (kind, namespaced, _) in self.infos.items():
            if gv_path(res) != group_version:
                continue
            scope = "/namespaces/{namespace}" if namespaced else ""
            gvk = {"group": res.group, "version": res.version, "kind": kind}
            param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
            operation = {"x-kubernetes-group-version-kind": gvk, "parameters": [param], "responses": {}}
            paths[f"/{group_version}{scope}/{res.plural}/{{name}}"] = {"patch": operation}
        if not paths:
            return aiohttp.web.json_response({"kind": "Status", "code": 404, "message": "not found"}, status=404)
        return aiohttp.web.json_response({"openapi": "3.0.0", "info": {"title": "emulated", "version": "v1"},
                                          "paths": paths})  # fmt: skip

    # --- writes -----------------------------------------------------------------------------------------------

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self.request_log.append(request)
        try:
            return await self._serve(request)
        finally:
            # kmock matches every new request against its whole request log, so a long run grows quadratic: a
            # request leaves that log once answered (a watch when it ends); tests read `request_log` instead.
            for index, pending in enumerate(self._requests):
                if pending is request:
                    del self._requests[index]
                    break

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res not in self.infos:
            return await super()._handle(request)
        method = str(request.method.value).upper()
        if method == "POST" and request.name is None:
            result = await self._create(request)
        elif method in ("PATCH", "PUT") and request.name is not None:
            result = await self._update(request, method)
        elif method == "DELETE" and request.name is not None:
            result = await self._delete(res, request.namespace, request.name)
        else:
            return await super()._handle(request)
        created = method == "POST" or id(request) in self.applies_that_created
        return aiohttp.web.json_response(result, status=201 if created else 200)

    async def _publish(self, resource, kind: str, obj: dict) -> None:
        with self.failures_lock:
            lost = next((x for x in self.lost if x == [kind, resource.plural]), None)
            if lost is not None:
                self.lost.remove(lost)
                return
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self.events.append((int(obj["metadata"]["resourceVersion"]), resource, event))
        if kind == "ADDED":
            meta = obj["metadata"]
            self.added_at[(obj.get("kind", ""), meta.get("namespace"), meta["name"])] = time.monotonic()
        for queue in list(self.watchers):
            queue.put_nowait((resource, event))

    def _bump(self, obj: dict) -> None:
        self.last_rv = next(self.rv)
        obj["metadata"]["resourceVersion"] = str(self.last_rv)

    def _admit(self, resource, obj: dict, strict: bool) -> dict:
        if obj.get("kind") == "CustomResourceDefinition" and self.validate_custom_resources:
            admit_crd(obj)  # the apiextensions-apiserver's checks of the CRD's own defaults
            return obj
        crd = self.crds.get(resource)
        if crd is None or not crd["schema"] or not self.validate_custom_resources:
            return obj
        return admit_custom_resource(obj, resource, crd["kind"], crd["schema"], strict=strict)

    async def _create(self, request: rendering.Request) -> dict:
        return await self._insert(request, copy.deepcopy(request.data or {}), applied=False)

    async def _insert(self, request: rendering.Request, obj: dict, *, applied: bool) -> dict:
        """Store a new object: a POST, or an apply of one that does not exist yet."""
        res = request.resource
        kind, namespaced, _ = self.infos[res]
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        namespace = (request.namespace or meta.get("namespace")) if namespaced else None
        key = (res, namespace, meta.get("name"))
        obj.setdefault("apiVersion", f"{res.group}/{res.version}".lstrip("/"))
        obj.setdefault("kind", kind)
        obj = self._admit(res, obj, strict=request.params.get("fieldValidation") == "Strict")
        manager = manager_of(request.params, request.headers)
        if applied:
            obj = server_side_apply(None, obj, manager, force=request.params.get("force") == "true")
        else:
            obj.get("metadata", {}).pop("managedFields", None)
            record_update(None, obj, manager)
        async with self._lock:
            if key in self.objects and not self.objects[key].deleted:
                raise api_status(409, "AlreadyExists", f'{kind.lower()}s "{meta.get("name")}" already exists')
            meta = obj["metadata"]
            if namespace:
                meta["namespace"] = namespace
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            for drop in ("deletionTimestamp", "resourceVersion"):
                meta.pop(drop, None)
            self._bump(obj)
            if key in self.objects:
                self.objects[key].create(obj)
            else:
                self.objects[key] = obj
            await self._publish(res, "ADDED", obj)
            if kind == "CustomResourceDefinition":
                self._register_crd(obj)
            if self._orphaned(obj):  # the garbage collector deletes what names only owners that are gone
                await self._remove(res, key)
        return obj

    def _orphaned(self, obj: dict) -> bool:
        refs = obj["metadata"].get("ownerReferences") or []
        live = {o.raw["metadata"].get("uid") for o in self.objects.values() if not o.deleted} if refs else set()
        return bool(refs) and not any(ref.get("uid") in live for ref in refs)

    async def _update(self, request: rendering.Request, method: str) -> dict:
        res, sub = request.resource, request.subresource
        key = (res, request.namespace, request.name)
        content_type = request.headers.get("Content-Type", "application/json").split(";")[0]
        manager = manager_of(request.params, request.headers)
        if content_type == APPLY_PATCH:
            if not request.params.get("fieldManager"):
                raise api_status(422, "Invalid", "PatchOptions.meta.k8s.io is invalid: fieldManager: Required value: "
                                 "is required for apply patch")  # fmt: skip
            if not isinstance(request.data, dict):
                raise api_status(400, "BadRequest", "error decoding YAML: the apply patch is not an object")
        elif request.params.get("force"):
            raise api_status(422, "Invalid", "PatchOptions.meta.k8s.io is invalid: force: Forbidden: "
                             "may not be specified for non-apply patch")  # fmt: skip
        async with self._lock:
            missing = key not in self.objects or self.objects[key].deleted
        if missing and content_type == APPLY_PATCH and sub is None:
            self.applies_that_created[id(request)] = request
            return await self._insert(request, copy.deepcopy(request.data), applied=True)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise api_status(404, "NotFound", f'{res.plural} "{request.name}" not found')
            current = copy.deepcopy(self.objects[key].raw)
            if sub == "scale":
                return await self._update_scale(res, key, current, request, method, manager)
            given = request.data
            if method == "PUT":
                wanted = copy.deepcopy(given)
            elif content_type == "application/json-patch+json":
                try:
                    wanted = jsonpatch.apply_patch(current, given)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    raise api_status(422, "Invalid", f"the JSON patch could not be applied: {exc}") from exc
            elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                wanted = merge_patch(current, given)
            elif content_type == APPLY_PATCH:
                force = request.params.get("force") == "true"
                wanted = server_side_apply(current, copy.deepcopy(given), manager, force)
            else:
                raise api_status(415, "UnsupportedMediaType", f"{content_type} is not supported by the test server")
            given_rv = ((given if isinstance(given, dict) else {}).get("metadata") or {}).get("resourceVersion")
            if given_rv and given_rv != current["metadata"]["resourceVersion"]:
                raise api_status(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version and try again",
                )
            strict = request.params.get("fieldValidation") == "Strict"
            owners = None if content_type == APPLY_PATCH else manager
            return await self._store(res, key, current, wanted, sub, strict=strict, manager=owners)

    async def _store(
        self, res, key, current: dict, wanted: dict, sub: str | None, *, strict: bool = False, manager: str | None
    ) -> dict:
        """Write `wanted` over `current` the way the server would (caller holds the lock). `manager` made the change
        with an update (None: an apply, which has set the managed fields itself)."""
        has_status = "status" in self.infos[res][2]
        if sub == "status":
            wanted = {**current, "status": wanted.get("status")}
        elif has_status:
            wanted = {**wanted, "status": current.get("status")}
            if wanted["status"] is None:
                wanted.pop("status")
        meta = wanted.setdefault("metadata", {})
        for fixed in ("uid", "creationTimestamp", "name", "namespace", "generation", "deletionTimestamp"):
            if fixed in current["metadata"]:
                meta[fixed] = current["metadata"][fixed]
            else:
                meta.pop(fixed, None)

        def body(obj: dict) -> dict:
            return {k: v for k, v in obj.items() if k not in ("metadata", "status")}

        if body(wanted) != body(current):
            wanted = self._admit(res, wanted, strict=strict)
            meta = wanted["metadata"]
            meta["generation"] = current["metadata"].get("generation", 1) + 1
        if sub == "status":
            meta["managedFields"] = current["metadata"].get("managedFields") or []
        elif manager is not None:
            record_update(current, wanted, manager)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        if wanted == current:
            return current  # a no-op write changes nothing, not even the resourceVersion
        self._bump(wanted)
        self.objects[key].create(wanted)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(res, key)
        else:
            await self._publish(res, "MODIFIED", wanted)
        return wanted

    def _scale_paths(self, res) -> tuple[str, str, str | None]:
        crd = self.crds.get(res)
        if crd is not None:
            scale = crd["scale"] or {}
            return scale.get("specReplicasPath"), scale.get("statusReplicasPath"), scale.get("labelSelectorPath")
        return ".spec.replicas", ".status.replicas", None

    def _scale_of(self, res, obj: dict) -> dict:
        spec_path, status_path, selector_path = self._scale_paths(res)
        selector = jsonpath(obj, selector_path) if selector_path else None
        if selector is None and res.plural == "deployments":
            labels = obj["spec"]["selector"].get("matchLabels") or {}
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        meta = obj["metadata"]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")},
            "spec": {"replicas": jsonpath(obj, spec_path) or 0},
            "status": {"replicas": jsonpath(obj, status_path) or 0, **({"selector": selector} if selector else {})},
        }

    async def _update_scale(
        self, res, key, current: dict, request: rendering.Request, method: str, manager: str
    ) -> dict:
        scale = self._scale_of(res, current)
        wanted_scale = request.data if method == "PUT" else merge_patch(scale, request.data)
        if request.headers.get("Content-Type", "").startswith("application/json-patch+json"):
            wanted_scale = jsonpatch.apply_patch(scale, request.data)
        replicas = wanted_scale["spec"]["replicas"]
        spec_path = self._scale_paths(res)[0]
        wanted = copy.deepcopy(current)
        target = wanted
        *parents, leaf = spec_path.strip(".").split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = replicas
        stored = await self._store(res, key, current, wanted, None, manager=manager)
        return self._scale_of(res, stored)

    async def _delete(self, res, namespace: str | None, name: str) -> dict:
        key = (res, namespace, name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise api_status(404, "NotFound", f'{res.plural} "{name}" not found')
            current = copy.deepcopy(self.objects[key].raw)
            if current["metadata"].get("finalizers"):
                if not current["metadata"].get("deletionTimestamp"):
                    current["metadata"]["deletionTimestamp"] = _now()
                    self._bump(current)
                    self.objects[key].create(current)
                    await self._publish(res, "MODIFIED", current)
                return current
            return await self._remove(res, key)

    async def _remove(self, res, key) -> dict:
        """Gone for good; then play the garbage collector: delete what this object owned, unless another owner of it
        still exists (caller holds the lock)."""
        obj = copy.deepcopy(self.objects[key].raw)
        self._bump(obj)
        self.objects[key].delete()
        await self._publish(res, "DELETED", obj)
        uid = obj["metadata"]["uid"]
        owned = [
            (k, v)
            for k, v in list(self.objects.items())
            if not v.deleted and any(ref.get("uid") == uid for ref in v.raw["metadata"].get("ownerReferences") or [])
        ]
        live = {o.raw["metadata"].get("uid") for o in self.objects.values() if not o.deleted}
        for child_key, child in owned:
            others = [
                r for r in child.raw["metadata"]["ownerReferences"] if r.get("uid") != uid and r.get("uid") in live
            ]
            if others:  # another owner lives on: the dependent stays, less the dangling reference
                kept = copy.deepcopy(child.raw)
                kept["metadata"]["ownerReferences"] = others
                self._bump(kept)
                child.create(kept)
                await self._publish(child_key[0], "MODIFIED", kept)
            elif child.raw["metadata"].get("finalizers"):
                marked = copy.deepcopy(child.raw)
                marked["metadata"]["deletionTimestamp"] = _now()
                self._bump(marked)
                child.create(marked)
                await self._publish(child_key[0], "MODIFIED", marked)
            else:
                await self._remove(child_key[0], child_key)
        return obj

    def _register_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            res = R(spec["group"], version["name"], names["plural"])
            subresources = tuple(version.get("subresources") or {})
            self._register(
                res, names["kind"], spec["scope"] == "Namespaced", subresources,
                names.get("shortNames", ()), names.get("categories", ()),
            )  # fmt: skip
            self.crds[res] = {
                "kind": names["kind"],
                "schema": (version.get("schema") or {}).get("openAPIV3Schema"),
                "columns": version.get("additionalPrinterColumns") or [],
                "scale": (version.get("subresources") or {}).get("scale"),
            }

    # --- reads ------------------------------------------------------------------------------------------------

    def _visible(self, request: rendering.Request) -> list[dict]:
        labels, fields = request.params.get("labelSelector", ""), request.params.get("fieldSelector", "")
        found = []
        for (res, namespace, name), obj in self.objects.items():
            if res != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if request.name is not None and name != request.name:
                continue
            raw = obj.raw
            if match_labels(raw["metadata"].get("labels") or {}, labels) and match_fields(raw, fields):
                found.append(copy.deepcopy(raw))
        return found

    def _wants_table(self, request: rendering.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    def _table(self, res, items: list[dict]) -> dict:
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
        specs = (self.crds.get(res) or {}).get("columns") or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
        ]
        for c in specs:
            columns.append({"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                            "description": c.get("description", ""), "priority": c.get("priority", 0)})  # fmt: skip
        rows = []
        for obj in items:
            cells = [obj["metadata"]["name"]]
            for column in specs:
                value = jsonpath(obj, column["jsonPath"])
                if column["type"] == "date" and value:  # the server prints dates as ages, like kubectl's AGE
                    value = _age(value)
                cells.append(value)
            partial = {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": obj["metadata"]}
            rows.append({"cells": cells, "object": partial})
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": str(self.last_rv)},
            "columnDefinitions": columns,
            "rows": rows,
        }

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self.infos:
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._visible(request)
        if self._wants_table(request):
            return self._table(request.resource, items)
        res = request.resource
        return {
            "apiVersion": f"{res.group}/{res.version}".lstrip("/"),
            "kind": f"{self.infos[res][0]}List",
            "metadata": {"resourceVersion": str(self.last_rv)},
            "items": items,
        }

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            items = self._visible(request)
        if not items:
            raise api_status(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')
        if request.subresource == "scale":
            return self._scale_of(request.resource, items[0])
        if request.subresource == "log":
            return self._pod_log(items[0], request)
        if self._wants_table(request):
            return self._table(request.resource, items)
        return items[0]

    def _pod_log(self, pod: dict, request: rendering.Request) -> bytes:
        """kube-apiserver asks the pod's kubelet; here the node agent that runs it (`pod_logs`), if a test has one."""
        if self.pod_logs is None:
            raise api_status(400, "BadRequest", f'pod "{pod["metadata"]["name"]}": no node serves its log here')
        text = self.pod_logs(pod["metadata"]["name"], request.params.get("container"))
        if request.params.get("tailLines"):
            text = "".join(line + "\n" for line in text.splitlines()[-int(request.params["tailLines"]) :])
        return text.encode()

    def _serve_watch(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        return rendering.Response(headers={"Content-Type": "application/json"}, payload=watch_events(self, request))

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        result = await super()._serve_version(request)
        if request.resource.group == "":
            result["groupVersion"] = "v1"
        for entry in result["resources"]:
            entry["verbs"] = sorted(entry["verbs"])
            if "/" in entry["name"]:  # a subresource: no short names or categories of its own
                entry.update(verbs=["get", "patch", "update"], shortNames=[], categories=[])
                if entry["name"].endswith("/scale"):
                    entry.update(kind="Scale", group="autoscaling", version="v1")
        return result
