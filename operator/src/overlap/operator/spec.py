"""Reading an InferenceService spec: the engine config it asks for, and the checks the schema may have missed.

The CRD (crds/) enforces types, bounds, enums and the cross-field CEL rules on a real API server. The operator
checks again here, so that a spec that slipped past (an older CRD, a server without CEL) sets Degraded with a
clear message instead of rolling out a pod that cannot start. Pure functions, no Kubernetes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from overlap.engine.config import EngineConfig, LiveKnobs, camel_case
from overlap.engine.delivery.uri import ModelURI, ModelURIError
from overlap.engine.delivery.uri import parse as parse_uri
from overlap.engine.errors import ConfigError

# The EngineConfig fields a spec may set besides the live knobs (those need a restart).
_RESTART_FIELDS = ("kv_cache_ratio", "max_seq_len", "num_priority_levels", "dtype", "batching", "queue_policy",
                   "block_size", "enable_prefix_caching", "enable_chunked_prefill", "simulated_device",
                   "tensor_parallel_size", "max_loras", "max_lora_rank", "max_cpu_loras")  # fmt: skip
# CRD `spec.engine` field (camelCase, by camel_case) -> EngineConfig field (snake_case).
ENGINE_FIELDS: dict[str, str] = {
    **{camel_case(name): name for name in (*LiveKnobs.names(), *_RESTART_FIELDS)},
    "speculative": "speculative_config",
}
# engine.speculative (camelCase) -> vLLM's speculative_config keys; `model` is a uri here, the draft's link there
SPECULATIVE_FIELDS = {"method": "method", "numSpeculativeTokens": "num_speculative_tokens", "model": "model",
                      "promptLookupMin": "prompt_lookup_min", "promptLookupMax": "prompt_lookup_max"}  # fmt: skip

# A fetched model (model.uri): the cache volume's mount and the link the fetch leaves for the engine, in the pod.
MODEL_CACHE_DIR = "/var/cache/overlap-models"
MODEL_LINK_DIR = "/var/run/overlap-model"
MODEL_LINK = f"{MODEL_LINK_DIR}/current"
DRAFT_LINK = f"{MODEL_LINK_DIR}/draft"  # engine.speculative.model, fetched by the same fetch container
DEFAULT_MODEL_CACHE_HOSTPATH = "/var/lib/overlap/models"
MODEL_IMAGE_DIR = "/var/run/overlap-model-image"  # an oci:// model mounted as an image volume; the model is models/
REGISTRY_CONFIG_DIR = "/var/run/overlap-registry"  # DOCKER_CONFIG of an oci:// fetch: the pull Secret's config.json

# The live knobs the tuner may move (spec.tuning.bounds holds them camelCased).
TUNABLE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "num_buffers")


# autoscaling.mode values under which decide() computes replica moves (builtin applies them, advise reports them).
SCALING_MODES = ("builtin", "advise")
# routing.mode values: service (the Service spreads requests over the pods), prefix (`overlap router` picks a pod).
ROUTING_MODES = ("service", "prefix")

# The CRD's defaults, as a real API server fills them in. The operator applies them too (a spec written to a
# server without structural defaulting still works); tests/operator check this table against crds/.
DEFAULTS: dict[str, Any] = {
    "model": {"source": "image", "mountPath": "/models", "cache": {}, "imageVolume": False},
    "images": {"pullPolicy": "IfNotPresent"},
    "resources": {
        "gpus": 1,
        "gpuResourceName": "nvidia.com/gpu",
        "engine": {"cpu": "2", "memory": "10Gi"},
        "sidecar": {"cpu": "1", "memory": "1Gi"},
    },
    "replicas": 1,
    "rollout": {"maxSurge": 1, "maxUnavailable": 0},
    "autoscaling": {
        "mode": "off",
        "minReplicas": 1,
        "maxReplicas": 4,
        "queueWatermarkPerReplica": 32,
        "scaleDownWatermark": 4,
        "scaleUpWindowSeconds": 30,
        "scaleDownWindowSeconds": 120,
        "scaleUpCooldownSeconds": 60,
        "scaleDownCooldownSeconds": 300,
        "startupDeadlineSeconds": 600,
        "intervalSeconds": 15,
        "idleTimeoutSeconds": 600,
        "predictive": {"enabled": True, "targetUtilization": 0.9, "coldStartSeconds": 60, "periodSeconds": 86400},
    },
    "engine": {
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 2048,
        "numBuffers": 2,
        "kvCacheRatio": 0.7,
        "maxSeqLen": 2048,
        "numPriorityLevels": 3,
        "agingSeconds": 5,
        "dtype": "auto",
        "batching": "continuous",
        "queuePolicy": "priority",
        "blockSize": 16,
        "enablePrefixCaching": True,
        "enableChunkedPrefill": True,
        "maxLoras": 1,
        "maxLoraRank": 16,
    },
    "tuning": {"enabled": False, "intervalSeconds": 30},
    "sidecar": {
        "port": 8000,
        "adminPort": 8001,
        "maxQueuedRequests": 64,
        "maxQueuedTokens": 262144,
        "maxInflight": 256,
        "requestTimeoutSeconds": 300,
        "gracePeriodSeconds": 30,
    },
    "routing": {"mode": "service", "routerReplicas": 1, "sessionHeader": "x-session-id"},
    "prometheus": {"serviceMonitor": {"enabled": True, "interval": "15s"}},
}


MODEL_IMAGE_REPOSITORY = "ghcr.io/overlap-dev/overlap"


@functools.cache
def own_model_image() -> str:
    """The engine image of this operator's own version: the images of a service that names none, unless the operator
    was given one (its --model-image, which the chart sets from its release). Looked up once: with_defaults runs at
    every reconcile and control tick, and the lookup scans the installed distributions."""
    from importlib.metadata import version

    return f"{MODEL_IMAGE_REPOSITORY}:{version('overlap-operator')}"


def with_defaults(spec: Mapping[str, Any], model_image: str | None = None) -> dict[str, Any]:
    """A copy of `spec` with the CRD's defaults filled in where a field is absent (nested), and `model_image` (the
    operator's OperatorSettings.model_image; None: `own_model_image()`) where it names no image."""

    def merge(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
        result = dict(given)
        for key, default in defaults.items():
            if key not in result:
                result[key] = merge(default, {}) if isinstance(default, Mapping) else default
            elif isinstance(default, Mapping) and isinstance(result[key], Mapping):
                result[key] = merge(default, result[key])
        return result

    merged = merge(DEFAULTS, spec)
    # The images are the operator's, not the CRD's: a default the API server stored in each object at create time
    # would pin every service to the version it was created under, and an operator upgrade would move none.
    image = model_image or own_model_image()
    merged["images"] = {"engine": image, "sidecar": image, **merged["images"]}
    api_key = merged["sidecar"].get("apiKeySecret")
    if api_key is not None:
        merged["sidecar"]["apiKeySecret"] = {"key": "api-key", **api_key}
    return merged


class SpecError(ValueError):
    """The spec cannot be turned into a running service; the message says what to fix."""


def model_uri(model: Mapping[str, Any]) -> ModelURI | None:
    """The parsed model.uri, None without one (SpecError when it is not a model uri)."""
    if not model.get("uri"):
        return None
    try:
        return parse_uri(model["uri"])
    except ModelURIError as exc:
        raise SpecError(f"model.uri {exc}") from exc


def model_fetched(model: Mapping[str, Any]) -> bool:
    """Whether an init container fetches the model into the cache (not a path, a claim, or an image volume)."""
    uri = model_uri(model)
    return uri is not None and uri.fetched and not (uri.scheme == "oci" and model.get("imageVolume"))


def model_path(model: Mapping[str, Any]) -> str:
    """Where the engine reads the model folder: model.path, the link a fetch leaves, the image volume's models/, or
    the path in a pvc:// claim."""
    uri = model_uri(model)
    if uri is None:
        return str(model.get("path", ""))
    if model_fetched(model):
        return MODEL_LINK
    if uri.scheme == "oci":
        return f"{MODEL_IMAGE_DIR}/models"
    mount = str(model.get("mountPath", DEFAULTS["model"]["mountPath"])).rstrip("/")
    return f"{mount}/{uri.path}" if uri.path else mount


# The CRD's rules on engine.speculative say the same (one sentence each there).
DRAFT_MESSAGE = "engine.speculative.model is required with method draft_model, and refused with method ngram"
LOOKUP_MESSAGE = "engine.speculative.promptLookupMin and promptLookupMax go with method ngram"


def draft_uri(spec: Mapping[str, Any]) -> ModelURI | None:
    """The parsed engine.speculative.model (a draft_model's draft), None without one; SpecError when it is not a
    uri the pod's fetch container fetches."""
    text = ((spec.get("engine") or {}).get("speculative") or {}).get("model")
    if not text:
        return None
    if {".", ".."} & set(str(text).split("/")):
        raise SpecError("engine.speculative.model must not hold '.' or '..' segments")
    try:
        uri = parse_uri(str(text))
    except ModelURIError as exc:
        raise SpecError(f"engine.speculative.model {exc}") from exc
    if not uri.fetched:
        raise SpecError("engine.speculative.model: a pvc:// uri cannot be fetched; use a fetched scheme")
    return uri


def fetch_subject(spec: Mapping[str, Any]) -> str | None:
    """What the pod's fetch container fetches, as ModelReady names it (the model's uri, its draft's, or both); None
    when the pod has no fetch container."""
    model, draft = spec.get("model") or {}, draft_uri(spec)
    named = [model["uri"]] if model_fetched(model) else []
    if draft is not None:
        named.append(f"draft {draft.text}")
    return " with ".join(named) or None


def engine_config(spec: Mapping[str, Any]) -> EngineConfig:
    """The EngineConfig that `spec` asks for (validated by EngineConfig itself)."""
    engine = spec.get("engine") or {}
    unknown = sorted(set(engine) - set(ENGINE_FIELDS))
    if unknown:
        raise SpecError(f"spec.engine has unknown fields: {', '.join(unknown)}")
    resources = spec.get("resources") or {}
    gpus = resources.get("gpus", 1)
    fields = {ENGINE_FIELDS[key]: value for key, value in engine.items()}
    if "simulated_device" in fields:  # the CRD's camelCase onto the cost profile's own keys
        sim = fields["simulated_device"]
        fields["simulated_device"] = {
            "fixed_s": sim.get("fixedSeconds", 0.0),
            "per_token_s": sim.get("perTokenSeconds", 0.0),
        }
    if "speculative_config" in fields:
        speculative = fields["speculative_config"] or {}
        unknown = sorted(set(speculative) - set(SPECULATIVE_FIELDS))
        if unknown:
            raise SpecError(f"spec.engine.speculative has unknown fields: {', '.join(unknown)}")
        method = speculative.get("method")
        if ("model" in speculative) != (method == "draft_model"):
            raise SpecError(DRAFT_MESSAGE)
        if method == "draft_model" and {"promptLookupMin", "promptLookupMax"} & set(speculative):
            raise SpecError(LOOKUP_MESSAGE)
        fields["speculative_config"] = {SPECULATIVE_FIELDS[key]: value for key, value in speculative.items()}
        if draft_uri(spec) is not None:  # the engine reads the draft where the fetch links it
            fields["speculative_config"]["model"] = DRAFT_LINK
    fields["model"] = model_path(spec.get("model") or {})
    fields["device"] = "cuda" if gpus > 0 else "cpu"
    fields["tensor_parallel_size"] = tensor_parallel_size(spec)
    # torch's intra-op threads per rank match the rank's share of the container's CPU limit (resources.engine.cpu
    # is per rank), not the node's core count (which would oversubscribe the cgroup's quota).
    fields["num_threads"] = cpu_threads(
        (resources.get("engine") or {}).get("cpu", DEFAULTS["resources"]["engine"]["cpu"])
    )
    if fields.get("dtype") == "auto" and gpus == 0:
        fields["dtype"] = "float32"  # bfloat16 on CPU is slow; "auto" means "what suits the device"
    try:
        return EngineConfig(**fields)
    except ConfigError as exc:
        raise SpecError(f"spec.engine: {exc}") from exc


# The CRD's rules on resources.gpus and engine.tensorParallelSize say the same (one sentence each there).
GPUS_MESSAGE = "resources.gpus must be 0 (CPU), 1, 2, 4 or 8: a model is split over 2, 4 or 8 GPUs of one pod"
TP_MESSAGE = "engine.tensorParallelSize must equal resources.gpus (one rank per GPU) when the pod has GPUs"


def tensor_parallel_size(spec: Mapping[str, Any]) -> int:
    """engine.tensorParallelSize, else one rank per GPU (1 on CPU)."""
    gpus = (spec.get("resources") or {}).get("gpus", 1)
    return int((spec.get("engine") or {}).get("tensorParallelSize") or max(gpus, 1))


def per_rank_cpu(quantity: Any, ranks: int) -> str:
    """The engine container's CPU for `ranks` ranks of `quantity` each, as a quantity ("4", "3500m")."""
    if ranks == 1:
        return str(quantity)
    text = str(quantity).strip()
    millis = int(text[:-1]) if text.endswith("m") else round(float(text) * 1000)
    total = millis * ranks
    return str(total // 1000) if total % 1000 == 0 else f"{total}m"


# The CRD's root rule says the same (one sentence there, folded by YAML).
NAME_MESSAGE = (
    "metadata.name must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter, at most 63 "
    "characters (it names the Service); e.g. llama-3-1-8b, not llama-3.1-8b"
)
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def check_name(name: str) -> None:
    """The name an InferenceService's children take (the CRD refuses others; a server without CEL would not)."""
    if len(name) > 63 or not _DNS_1035.match(name):
        raise SpecError(NAME_MESSAGE)


def cpu_threads(quantity: Any) -> int:
    """Whole CPUs in a Kubernetes CPU quantity ("4", 4, "3500m", "0.5"), at least 1: the engine's thread count."""
    text = str(quantity).strip()
    try:
        cores = int(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError as exc:
        raise SpecError(f'resources.engine.cpu {quantity!r} is not a CPU quantity (e.g. 4, "3500m")') from exc
    if not cores > 0:
        raise SpecError(f"resources.engine.cpu must be positive, got {quantity!r}")
    return max(1, int(cores))


def check_spec(spec: Mapping[str, Any]) -> EngineConfig:
    """Every cross-field rule of the CRD again (same messages as its CEL rules); returns the engine config."""
    model = spec.get("model") or {}
    if not model.get("servedName"):
        raise SpecError("spec.model needs servedName")
    if ("path" in model) == ("uri" in model):
        raise SpecError("set exactly one of model.path and model.uri")
    source = model.get("source", "image")
    if model_uri(model) is not None:
        if source != "image":
            raise SpecError("model.source, claimName and hostPath go with model.path; a uri names its own source")
        cache = model.get("cache") or {}
        if cache.get("claimName") and cache.get("hostPath"):
            raise SpecError("model.cache takes a claimName or a hostPath, not both")
        if model.get("imageVolume") and not str(model["uri"]).startswith("oci://"):
            raise SpecError("model.imageVolume goes with an oci:// model.uri")
        model = {**model, "path": model_path(model)}
    elif not str(model["path"]).startswith("/"):
        raise SpecError("spec.model.path must be an absolute path")
    if source == "pvc" and not model.get("claimName"):
        raise SpecError("model.claimName is required when model.source is pvc")
    if source == "hostPath" and not model.get("hostPath"):
        raise SpecError("model.hostPath is required when model.source is hostPath")
    path, mount = str(model["path"]), str(model.get("mountPath", DEFAULTS["model"]["mountPath"]))
    if {".", ".."} & {*path.split("/"), *mount.split("/")}:
        raise SpecError("model.path and model.mountPath must not hold '.' or '..' segments")
    if source != "image" and not (path + "/").startswith(mount.rstrip("/") + "/"):
        raise SpecError("model.path must be inside model.mountPath when model.source is pvc or hostPath")

    gpus = (spec.get("resources") or {}).get("gpus", 1)
    if gpus not in (0, 1, 2, 4, 8):
        raise SpecError(GPUS_MESSAGE)
    asked = (spec.get("engine") or {}).get("tensorParallelSize")
    if gpus > 0 and asked is not None and asked != gpus:
        raise SpecError(TP_MESSAGE)
    engine = spec.get("engine") or {}
    cpu_loras, loras = engine.get("maxCpuLoras"), engine.get("maxLoras", 1)
    if isinstance(cpu_loras, int) and isinstance(loras, int) and cpu_loras < loras:
        raise SpecError("engine.maxCpuLoras must be >= engine.maxLoras")
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 0:
        raise SpecError(f"spec.replicas must be an integer >= 0, got {replicas!r}")
    scaling = spec.get("autoscaling") or {}
    low, high = scaling.get("minReplicas", 1), scaling.get("maxReplicas", 4)
    if low > high:
        raise SpecError("autoscaling.minReplicas must be <= autoscaling.maxReplicas")
    rollout = spec.get("rollout") or {}
    surge, unavailable = (str(rollout.get(key, 0)).rstrip("%") for key in ("maxSurge", "maxUnavailable"))
    if surge == unavailable == "0":
        raise SpecError("rollout.maxSurge and rollout.maxUnavailable cannot both be 0: no pod could ever be replaced")

    config = engine_config(spec)
    bounds = (spec.get("tuning") or {}).get("bounds") or {}
    for knob in TUNABLE_KNOBS:
        name = camel_case(knob)
        if name not in bounds:
            continue
        lo, hi = bounds[name]["min"], bounds[name]["max"]
        if lo > hi:
            raise SpecError(f"tuning.bounds.{name}: min must be <= max")
        if not lo <= getattr(config, knob) <= hi:
            raise SpecError(f"tuning.bounds.{name} must contain engine.{name} (the start value)")

    mode = (spec.get("routing") or {}).get("mode", "service")
    if mode not in ROUTING_MODES:
        raise SpecError(f"routing.mode must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
    sidecar = spec.get("sidecar") or {}
    if sidecar.get("port", 8000) == sidecar.get("adminPort", 8001):
        raise SpecError("sidecar.port and sidecar.adminPort must differ")
    _check_volumes(spec.get("pod") or {}, str(spec["model"].get("mountPath", DEFAULTS["model"]["mountPath"])))
    return config


RESERVED_VOLUMES = (
    "socket",
    "config",
    "admin-token",
    "tmp",
    "dshm",
    "model",
    "model-cache",
    "model-link",
    "registry-config",
    "adapter-links",
    "adapter-list",
)
# every path the operator mounts into a container of the pod (the CRD's rule lists the same: test_crd holds them equal)
RESERVED_PATHS = ("/run/overlap", "/etc/overlap", "/var/run/secrets/overlap", "/tmp", "/dev/shm",
                  "/etc/overlap-adapters", "/var/run/overlap-adapters", MODEL_CACHE_DIR, MODEL_LINK_DIR,
                  MODEL_IMAGE_DIR, REGISTRY_CONFIG_DIR)  # fmt: skip


def _check_volumes(pod: Mapping[str, Any], model_mount: str) -> None:
    names = [volume.get("name") for volume in pod.get("volumes") or []]
    if any(name in RESERVED_VOLUMES for name in names):
        raise SpecError(f"pod.volumes cannot use the operator's names {', '.join(RESERVED_VOLUMES)}")
    mounts = pod.get("volumeMounts") or []
    if any(mount.get("mountPath") in RESERVED_PATHS for mount in mounts):
        raise SpecError(f"pod.volumeMounts cannot use the operator's paths {', '.join(RESERVED_PATHS)}")
    if any(str(mount.get("mountPath", "")).rstrip("/") == model_mount.rstrip("/") for mount in mounts):
        raise SpecError(f"pod.volumeMounts cannot use the model's mountPath {model_mount} (model.mountPath)")
    if any(mount.get("name") not in names for mount in mounts):
        raise SpecError("every pod.volumeMounts name must be one of pod.volumes")


def engine_json(config: EngineConfig) -> str:
    """The ConfigMap's engine.json: every EngineConfig field, snake_case, stable order."""
    return json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"


def restart_hash(config: EngineConfig) -> str:
    """A hash of the knobs the engine cannot change live: it goes into the pod template, so pods roll on change."""
    frozen = {key: value for key, value in config.to_dict().items() if key not in LiveKnobs.names()}
    return hashlib.sha256(json.dumps(frozen, sort_keys=True).encode()).hexdigest()[:16]


def tuned_config(config: EngineConfig, spec: Mapping[str, Any], status: Mapping[str, Any] | None) -> EngineConfig:
    """`config` with the knobs the tuner set (status.liveKnobs), while tuning is on.

    With spec.tuning.enabled, spec.engine's tunable knobs are start values and the tuner owns them afterwards, as
    the autoscaler owns spec.replicas; a tuned value outside today's bounds is dropped (the spec's value returns).
    """
    tuning = spec.get("tuning") or {}
    applied = (status or {}).get("liveKnobs") or {}
    if not tuning.get("enabled") or not applied:
        return config
    bounds = tuning.get("bounds") or {}
    tuned = {}
    for knob in TUNABLE_KNOBS:
        name = camel_case(knob)
        value = applied.get(name)
        if name in bounds and isinstance(value, int) and bounds[name]["min"] <= value <= bounds[name]["max"]:
            tuned[knob] = value
    try:
        return config.replace(**tuned)
    except ConfigError:  # e.g. a token budget below max_seq_len once chunked prefill was turned off
        return config
