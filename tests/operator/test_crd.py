"""The CRD refuses invalid InferenceServices with the message a user would read.

kmock enforces neither OpenAPI schemas nor CEL: the schema and the `x-kubernetes-validations` rules are evaluated
here (tests/support/kube/admission.py: structural defaulting, schema checks, CEL via cel-python), both directly
and through the emulated API server with the real kubectl, which prints what `kubectl apply` prints against a
real cluster.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from overlap.operator import adapters
from overlap.operator import spec as specs
from tests.support.kube import admission

REPO = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((REPO / "crds" / "inferenceservices.overlap.dev.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
VALID = {
    "apiVersion": "overlap.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llm"},
    "spec": {"model": {"servedName": "llm", "path": "/models/llm"}},
}


def with_spec(**spec) -> dict:
    obj = copy.deepcopy(VALID)
    obj["spec"].update(spec)
    return obj


def refusal(obj: dict, *, strict: bool = True) -> str:
    with pytest.raises((admission.Invalid, admission.UnknownFields)) as caught:
        admission.admit(obj, SCHEMA, strict=strict)
    return str(caught.value)


INVALID = [
    pytest.param(
        with_spec(autoscaling={"minReplicas": 5, "maxReplicas": 2}),
        'spec.autoscaling: Invalid value: "object": autoscaling.minReplicas must be <= autoscaling.maxReplicas',
        id="min-greater-than-max",
    ),
    pytest.param(
        with_spec(replicas=-1),
        "spec.replicas: Invalid value: -1: spec.replicas in body should be greater than or equal to 0",
        id="negative-replicas",
    ),
    pytest.param(
        with_spec(sidecar={"maxInflight": -4}),
        "spec.sidecar.maxInflight: Invalid value: -4: spec.sidecar.maxInflight in body should be greater than or "
        "equal to 1",
        id="negative-limit",
    ),
    pytest.param(
        with_spec(autoscaling={"mode": "aggressive"}),
        'spec.autoscaling.mode: Unsupported value: "aggressive": '
        'supported values: "builtin", "advise", "external", "off"',
        id="bad-enum",
    ),
    pytest.param(
        with_spec(engine={"speculative": {"method": "eagle3", "numSpeculativeTokens": 3}}),
        'spec.engine.speculative.method: Unsupported value: "eagle3": supported values: "ngram", "draft_model"',
        id="speculative-method-not-run",
    ),
    pytest.param(
        with_spec(engine={"speculative": {"method": "ngram"}}),
        "spec.engine.speculative.numSpeculativeTokens: Required value",
        id="speculative-without-k",
    ),
    pytest.param(
        with_spec(engine={"dtype": "float8"}),
        'spec.engine.dtype: Unsupported value: "float8": supported values: "auto", "bfloat16", "float16", "float32"',
        id="bad-dtype",
    ),
    pytest.param(
        with_spec(tuning={"bounds": {"maxNumSeqs": {"min": 128, "max": 256}}}),
        'spec: Invalid value: "object": tuning.bounds.maxNumSeqs must contain engine.maxNumSeqs (the start value)',
        id="bounds-exclude-start",
    ),
    pytest.param(
        with_spec(tuning={"bounds": {"numBuffers": {"min": 3, "max": 2}}}),
        'spec.tuning.bounds.numBuffers: Invalid value: "object": min must be <= max',
        id="bounds-min-greater-than-max",
    ),
    pytest.param(
        with_spec(engine={"kvCacheRatio": 0}),
        "spec.engine.kvCacheRatio: Invalid value: 0: spec.engine.kvCacheRatio in body should be greater than 0",
        id="exclusive-minimum",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm", "path": "/m", "source": "pvc"}),
        "model.claimName is required when model.source is pvc",
        id="pvc-without-claim",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm", "path": "models/llm"}),
        "spec.model.path: Invalid value: \"models/llm\": spec.model.path in body should match '^/'",
        id="relative-model-path",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm"}),
        'spec.model: Invalid value: "object": set exactly one of model.path and model.uri',
        id="neither-path-nor-uri",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm", "path": "/models/x", "uri": "hf://acme/x"}),
        'spec.model: Invalid value: "object": set exactly one of model.path and model.uri',
        id="path-and-uri",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm", "uri": "ftp://acme/x"}),
        'spec.model.uri: Invalid value: "ftp://acme/x": spec.model.uri in body should match '
        "'^(hf|s3|gs|https?|oci|pvc)://[^\\s]+$'",
        id="uri-scheme",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm", "uri": "hf://acme/x", "imageVolume": True}),
        'spec.model: Invalid value: "object": model.imageVolume goes with an oci:// model.uri',
        id="image-volume-without-oci",
    ),
    pytest.param(
        with_spec(model={"servedName": "llm", "uri": "hf://acme/x", "cache": {"hostPath": "/c", "claimName": "c"}}),
        'spec.model.cache: Invalid value: "object": model.cache takes a claimName or a hostPath, not both',
        id="cache-hostpath-and-claim",
    ),
    pytest.param(
        with_spec(replicas="two"),
        'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer: "string"',
        id="wrong-type",
    ),
    pytest.param(with_spec(replica=2), 'unknown field "spec.replica"', id="unknown-field"),
    pytest.param(
        with_spec(resources={"engine": {"cpu": "4 cores"}}),
        'spec.resources.engine.cpu: Invalid value: "4 cores": spec.resources.engine.cpu in body should match',
        id="cpu-not-a-quantity",
    ),
    pytest.param(
        with_spec(resources={"sidecar": {"memory": "1 GB"}}),
        'spec.resources.sidecar.memory: Invalid value: "1 GB": spec.resources.sidecar.memory in body should match',
        id="memory-not-a-quantity",
    ),
    pytest.param(
        with_spec(resources={"gpus": 3}),
        'spec.resources: Invalid value: "object": resources.gpus must be 0 (CPU), 1, 2, 4 or 8',
        id="three-gpus",
    ),
    pytest.param(
        with_spec(resources={"gpus": 2}, engine={"tensorParallelSize": 4}),
        'spec: Invalid value: "object": engine.tensorParallelSize must equal resources.gpus',
        id="ranks-not-gpus",
    ),
    pytest.param(
        with_spec(engine={"maxNumSeqs": 8, "maxBatchSize": 8}),
        'unknown field "spec.engine.maxBatchSize"',
        id="unknown-nested",
    ),
]
BAD_VOLUMES = [
    pytest.param({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "pod.volumes cannot use the operator's names",
                 id="reserved-volume-name"),
    pytest.param({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "b", "mountPath": "/b"}]},
                 "every pod.volumeMounts name must be one of pod.volumes", id="mount-of-no-volume"),
    pytest.param({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/tmp"}]},
                 "pod.volumeMounts cannot use the operator's paths", id="reserved-mount-path"),
]  # fmt: skip
INVALID += [pytest.param(with_spec(pod=p.values[0]), p.values[1], id=p.id) for p in BAD_VOLUMES]
# Model paths that would read outside the volume the weights are mounted from.
BAD_MODELS = [
    pytest.param({"path": "/models/../etc", "source": "pvc", "claimName": "w"},
                 "model.path and model.mountPath must not hold '.' or '..' segments", id="model-path-climbs-out"),
    pytest.param({"path": "/m", "source": "hostPath", "hostPath": "/w", "mountPath": "/a/."},
                 "model.path and model.mountPath must not hold '.' or '..' segments", id="mount-path-dot"),
    pytest.param({"path": "/opt/llm", "source": "pvc", "claimName": "w"},
                 "model.path must be inside model.mountPath when model.source is pvc or hostPath",
                 id="model-path-outside-its-volume"),
    pytest.param({"path": "/modelsx/llm", "source": "pvc", "claimName": "w"},
                 "model.path must be inside model.mountPath when model.source is pvc or hostPath",
                 id="model-path-beside-its-volume"),
]  # fmt: skip
INVALID += [
    pytest.param(with_spec(model={"servedName": "llm", **p.values[0]}), p.values[1], id=p.id) for p in BAD_MODELS
]


SQL = {"name": "sql", "uri": "hf://acme/sql-lora"}
# spec.adapters the CRD refuses; the first three the operator refuses too, in the same words
BAD_ADAPTERS = [
    pytest.param([SQL, {**SQL, "uri": "s3://loras/sql"}], "adapter names must be unique", id="adapter-twice"),
    pytest.param([{"name": "llm", "uri": "hf://acme/x"}],
                 "an adapter's name must differ from model.servedName", id="adapter-named-as-the-model"),
    pytest.param([{"name": "sql", "uri": "https://loras.example/a/../b.tar"}],
                 "an adapter's uri must not hold '.' or '..' segments", id="adapter-uri-dot-dot"),
    pytest.param([{"name": "sql", "uri": "pvc://loras/sql"}], "spec.adapters[0].uri in body should match",
                 id="adapter-from-a-claim"),
    pytest.param([{"name": "SQL_lora", "uri": "hf://acme/x"}], "spec.adapters[0].name in body should match",
                 id="adapter-name-not-dns"),
    pytest.param([{"name": "sql"}], "spec.adapters[0].uri: Required value", id="adapter-without-uri"),
]  # fmt: skip
INVALID += [pytest.param(with_spec(adapters=p.values[0]), p.values[1], id=p.id) for p in BAD_ADAPTERS]


@pytest.mark.parametrize(("obj", "message"), INVALID)
def test_invalid_specs_are_refused_with_a_clear_message(obj: dict, message: str) -> None:
    assert message in refusal(obj)


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"autoscaling": {"mode": "builtin", "minReplicas": 1, "maxReplicas": 8}, "replicas": 2},
        {
            "tuning": {
                "enabled": True,
                "bounds": {"maxNumSeqs": {"min": 16, "max": 256}, "numBuffers": {"min": 1, "max": 3}},
            }
        },
        {"model": {"servedName": "m", "path": "/models/m", "source": "pvc", "claimName": "weights"}},
        {"engine": {"enableChunkedPrefill": False, "maxSeqLen": 1024, "maxNumBatchedTokens": 1024}},
        {"resources": {"gpus": 0, "engine": {"cpu": 8, "memory": "8Gi"}}},
        {"resources": {"engine": {"cpu": "3500m", "memory": "16e9"}, "sidecar": {"cpu": "0.5", "memory": "512Mi"}}},
        {
            "pod": {
                "runtimeClassName": "nvidia",
                "labels": {"team": "a"},
                "env": [{"name": "X", "value": "1"}],
                "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}],
                "startupSeconds": 600,
                "volumes": [{"name": "adapters", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}}],
                "volumeMounts": [{"name": "adapters", "mountPath": "/adapters", "readOnly": True}],
            }
        },
        # `kubectl scale` or a GitOps re-apply in builtin mode: admitted; the loop brings it back within the bounds
        {"autoscaling": {"mode": "builtin", "minReplicas": 2, "maxReplicas": 4}, "replicas": 9},
    ],
    ids=[
        "defaults",
        "builtin-autoscaling",
        "tuning-bounds",
        "pvc",
        "no-chunked-prefill",
        "cpu-only",
        "quantities",
        "pod-overrides",
        "replicas-outside-the-loops-bounds",
    ],
)
def test_valid_specs_are_admitted_and_defaulted(spec: dict) -> None:
    stored = admission.admit(with_spec(**spec), SCHEMA, strict=True)
    assert stored["spec"]["engine"]["maxNumSeqs"] >= 1 and stored["spec"]["sidecar"]["port"] == 8000
    specs.check_spec(stored["spec"])  # the operator agrees with the schema


@pytest.mark.parametrize(("listed", "message"), [p.values for p in BAD_ADAPTERS[:3]])
def test_the_operator_refuses_bad_adapters_with_the_crds_words(listed, message) -> None:
    with pytest.raises(specs.SpecError, match=message.replace(".", r"\.")):
        adapters.check(specs.with_defaults(with_spec(adapters=listed)["spec"]))


def test_adapters_are_admitted_with_an_api_key_too() -> None:
    """The operator loads adapters through the pods' admin port (its own token), not the API the key guards."""
    two = [SQL, {"name": "chat.v2", "uri": "oci://registry.example/loras/chat:v2"}]
    stored = admission.admit(with_spec(adapters=two), SCHEMA, strict=True)
    adapters.check(stored["spec"])
    assert adapters.listed(stored["spec"]) == {"sql": SQL["uri"], "chat.v2": two[1]["uri"]}
    keyed = admission.admit(with_spec(adapters=two, sidecar={"apiKeySecret": {"name": "k"}}), SCHEMA, strict=True)
    adapters.check(specs.with_defaults(keyed["spec"]))
    specs.check_spec(specs.with_defaults(keyed["spec"]))


def test_engine_speculative_reaches_the_engine_as_vllms_speculative_config() -> None:
    spec = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3}
    stored = admission.admit(with_spec(engine={"speculative": spec}), SCHEMA, strict=True)
    config = specs.check_spec(stored["spec"])
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3,
                                         "prompt_lookup_max": 3}  # fmt: skip
    assert json.loads(specs.engine_json(config))["speculative_config"] == config.speculative_config
    too_wide = specs.with_defaults(with_spec(engine={"speculative": {**spec, "promptLookupMin": 5}})["spec"])
    with pytest.raises(specs.SpecError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(3\)"):
        specs.check_spec(too_wide)


def test_unknown_fields_are_pruned_without_strict_validation() -> None:
    stored = admission.admit(with_spec(replica=2), SCHEMA, strict=False)
    assert "replica" not in stored["spec"]


def test_every_example_is_admitted() -> None:
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert len(examples) >= 3
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                stored = admission.admit(doc, SCHEMA, strict=True)
                specs.check_spec(stored["spec"])


def test_operator_defaults_match_the_crd() -> None:
    stored = admission.admit(VALID, SCHEMA, strict=True)
    defaulted = specs.with_defaults(VALID["spec"])
    assert defaulted["images"].pop("engine") == defaulted["images"].pop("sidecar") == specs.own_model_image()
    assert defaulted == stored["spec"]  # the images aside (the operator's own), one table of defaults


def test_images_come_from_the_running_operator_not_the_stored_object() -> None:
    # an image the API server stored at create time would pin the service to that version through every upgrade
    stored = admission.admit(VALID, SCHEMA, strict=True)["spec"]
    assert "engine" not in stored["images"] and "sidecar" not in stored["images"]
    image = "registry.example/overlap:0.2.0"  # the operator's --model-image (OperatorSettings.model_image)
    assert specs.with_defaults(stored, image)["images"]["engine"] == image
    named = with_spec(images={"engine": "mine/engine:1"})["spec"]
    images = specs.with_defaults(named, image)["images"]
    assert (images["engine"], images["sidecar"]) == ("mine/engine:1", image)


def test_every_signal_the_loop_reads_can_be_overridden_through_the_crd() -> None:
    """A spec.prometheus.queries key the schema lacks is pruned by the API server: its override would never arrive."""
    from overlap.operator.control.signals import SIGNAL_FIELDS

    prometheus = SCHEMA["properties"]["spec"]["properties"]["prometheus"]["properties"]
    assert set(prometheus["queries"]["properties"]) == set(SIGNAL_FIELDS)


def test_the_control_policys_defaults_are_the_crds() -> None:
    """A policy built with no arguments behaves as the policy of a service that sets nothing the API server would
    default: one table (the CRD's defaults) behind both."""
    from overlap.operator.control.policy import Policy

    defaulted = admission.admit(VALID, SCHEMA, strict=True)["spec"]  # VALID sets the model only
    assert Policy.from_spec(defaulted) == Policy()


def test_every_cel_rule_compiles_and_has_a_message() -> None:
    rules = []

    def walk(node: dict) -> None:
        rules.extend(node.get("x-kubernetes-validations") or [])
        for child in (node.get("properties") or {}).values():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])

    walk(SCHEMA)
    assert len(rules) >= 10
    for rule in rules:
        assert rule.get("message"), rule
        admission._cel_env.compile(rule["rule"])


def test_scale_subresource_and_printer_columns() -> None:
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    names = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert {"Ready", "Replicas", "Model", "URL", "Age"} <= set(names)
    assert CRD["spec"]["names"]["shortNames"] == ["oisvc"]


BAD_MANIFEST = """
apiVersion: overlap.dev/v1alpha1
kind: InferenceService
metadata: {name: bad}
spec:
  model: {servedName: bad, path: /models/bad}
  autoscaling: {minReplicas: 5, maxReplicas: 2}
"""


def test_kubectl_apply_prints_the_refusal(cluster) -> None:
    done = cluster.apply("-f", "-", stdin=BAD_MANIFEST, check=False)
    assert done.returncode != 0
    assert 'The InferenceService "bad" is invalid' in done.stderr
    assert "autoscaling.minReplicas must be <= autoscaling.maxReplicas" in done.stderr
    assert cluster.get("oisvc", "bad") is None
    print(done.stderr)  # what the user reads (shown with pytest -s)


def test_kubectl_apply_names_the_unknown_field(cluster) -> None:
    manifest = BAD_MANIFEST.replace("autoscaling: {minReplicas: 5, maxReplicas: 2}", "replica: 2")
    done = cluster.apply("-f", "-", stdin=manifest, check=False)
    assert done.returncode != 0
    assert done.stderr.strip() == (
        'Error from server (BadRequest): error when creating "STDIN": InferenceService in version "v1alpha1" '
        'cannot be handled as a InferenceService: strict decoding error: unknown field "spec.replica"'
    )


def test_strict_field_validation_names_the_unknown_field(cluster) -> None:
    from kubernetes.client.exceptions import ApiException

    body = with_spec(replica=2)
    with pytest.raises(ApiException) as caught:
        cluster.custom.create_namespaced_custom_object(
            "overlap.dev", "v1alpha1", "overlap-test", "inferenceservices", body, field_validation="Strict"
        )
    assert caught.value.status == 400
    message = json.loads(caught.value.body)["message"]
    assert message == (
        'InferenceService in version "v1alpha1" cannot be handled as a InferenceService: '
        'strict decoding error: unknown field "spec.replica"'
    )


@pytest.mark.parametrize(("pod", "message"), BAD_VOLUMES)
def test_the_operator_refuses_bad_extra_volumes_with_the_crds_words(pod: dict, message: str) -> None:
    with pytest.raises(specs.SpecError, match=message):
        specs.check_spec(specs.with_defaults(with_spec(pod=pod)["spec"]))


def test_the_crd_reserves_the_names_and_paths_the_operator_does():
    """Both refuse the same pod.volumes names and mount paths: what the API server admits, the operator takes."""
    pod = SCHEMA["properties"]["spec"]["properties"]["pod"]["properties"]

    def listed(field: str) -> tuple[str, ...]:
        return tuple(re.findall(r"'([^']+)'", pod[field]["x-kubernetes-validations"][0]["rule"]))

    assert listed("volumes") == specs.RESERVED_VOLUMES and listed("volumeMounts") == specs.RESERVED_PATHS
    # the model's own mountPath (a spec field, so the operator's check): a second mount there fails the Deployment
    pod_at_model = {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/models"}]}
    with pytest.raises(specs.SpecError, match=r"cannot use the model's mountPath /models"):
        specs.check_spec(specs.with_defaults(with_spec(pod=pod_at_model)["spec"]))


@pytest.mark.parametrize(("model", "message"), BAD_MODELS)
def test_the_operator_refuses_model_paths_that_leave_their_volume_with_the_crds_words(model, message) -> None:
    with pytest.raises(specs.SpecError, match=message.replace(".", r"\.")):
        specs.check_spec(specs.with_defaults(with_spec(model={"servedName": "llm", **model})["spec"]))


@pytest.mark.parametrize(
    "model",
    [
        {"path": "/models/llm", "source": "pvc", "claimName": "w"},
        {"path": "/weights", "source": "hostPath", "hostPath": "/w", "mountPath": "/weights/"},
        {"path": "/opt/llm"},
    ],
)  # the last: an image path may be anywhere
def test_model_paths_inside_their_volume_are_admitted(model) -> None:
    spec = with_spec(model={"servedName": "llm", **model})
    admission.admit(spec, SCHEMA, strict=True)
    specs.check_spec(specs.with_defaults(spec["spec"]))


@pytest.mark.parametrize(
    ("asked", "message"),
    [({"resources": {"gpus": 3}}, specs.GPUS_MESSAGE),
     ({"resources": {"gpus": 2}, "engine": {"tensorParallelSize": 4}}, specs.TP_MESSAGE)],
)  # fmt: skip
def test_the_operator_refuses_gpu_counts_tensor_parallelism_cannot_use_with_the_crds_words(asked, message) -> None:
    spec = specs.with_defaults(with_spec(**asked)["spec"])
    with pytest.raises(specs.SpecError) as caught:
        specs.check_spec(spec)
    assert str(caught.value) == message
    assert " ".join(refusal(with_spec(**asked)).split()).endswith(message)


@pytest.mark.parametrize(("gpus", "engine", "ranks", "cpu", "shm"),
                         [(2, {}, 2, "4", "2Gi"), (8, {}, 8, "16", "8Gi"), (1, {}, 1, "2", "1Gi"),
                          (0, {"tensorParallelSize": 2}, 2, "4", "2Gi"), (0, {}, 1, "2", "1Gi")])  # fmt: skip
def test_gpus_of_a_pod_become_tensor_parallel_ranks_with_cpu_and_shm_for_each(gpus, engine, ranks, cpu, shm) -> None:
    from overlap.operator import children

    spec = with_spec(resources={"gpus": gpus, "engine": {"cpu": "2"}}, engine=engine)
    admission.admit(spec, SCHEMA, strict=True)
    full = specs.with_defaults(spec["spec"])
    config = specs.check_spec(full)
    assert config.tensor_parallel_size == ranks and config.num_threads == 2  # threads per rank
    pod = children.build_deployment("llm", "ml", full, config)["spec"]["template"]["spec"]
    engine_container = next(c for c in pod["containers"] if c["name"] == "engine")
    assert engine_container["resources"]["limits"]["cpu"] == cpu
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == shm


def test_pod_env_takes_a_value_or_a_value_from_not_both() -> None:
    secret = {"secretKeyRef": {"name": "hf", "key": "token"}}
    admitted = admission.admit(with_spec(pod={"env": [{"name": "HF_TOKEN", "valueFrom": secret}]}), SCHEMA, strict=True)
    assert admitted["spec"]["pod"]["env"][0]["valueFrom"] == secret
    assert "an env entry takes value or valueFrom, not both" in refusal(
        with_spec(pod={"env": [{"name": "HF_TOKEN", "value": "x", "valueFrom": secret}]})
    )


def test_float16_the_fast_type_of_t4_and_v100_pools_is_admitted_and_reaches_the_engine() -> None:
    service = with_spec(engine={"dtype": "float16"}, resources={"gpus": 1})
    assert admission.admit(service, SCHEMA, strict=True)["spec"]["engine"]["dtype"] == "float16"
    assert specs.engine_config(specs.with_defaults(service["spec"])).dtype == "float16"


@pytest.mark.parametrize(("cpu", "threads"), [("4", 4), (8, 8), ("3500m", 3), ("500m", 1), ("0.5", 1), ("2.0", 2)])
def test_engine_threads_follow_the_cpu_limit(cpu, threads) -> None:
    config = specs.engine_config(specs.with_defaults(with_spec(resources={"engine": {"cpu": cpu}})["spec"]))
    assert config.num_threads == threads


@pytest.mark.parametrize("cpu", ["4 cores", "0", "-1m"])
def test_a_cpu_limit_that_is_no_quantity_is_a_spec_error(cpu) -> None:
    with pytest.raises(specs.SpecError, match=r"resources\.engine\.cpu"):
        specs.engine_config(specs.with_defaults(with_spec(resources={"engine": {"cpu": cpu}})["spec"]))


def test_the_crds_defaults_pass_its_own_schema_and_rules() -> None:
    """The apiextensions-apiserver checks each `default` against its level's schema and CEL rules on the raw value;
    an unguarded rule on a `default: {}` level refuses the whole CRD."""
    assert admission.crd_default_errors(CRD) == []


def _unguarded_crd() -> dict:
    """The CRD as it was before its rules were guarded with has(): autoscaling's first rule reads its fields bare."""
    crd = copy.deepcopy(CRD)
    scaling = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscaling"]
    scaling["x-kubernetes-validations"][0]["rule"] = "self.minReplicas <= self.maxReplicas"
    crd["metadata"]["name"] = "brokens.broken.overlap.dev"
    crd["spec"]["group"] = "broken.overlap.dev"
    crd["spec"]["names"] = {**crd["spec"]["names"], "plural": "brokens", "singular": "broken", "kind": "Broken",
                            "listKind": "BrokenList", "shortNames": ["brk"]}  # fmt: skip
    return crd


def test_an_unguarded_rule_on_a_defaulted_level_refuses_the_crd_as_the_api_server_does(cluster) -> None:
    causes = admission.crd_default_errors(_unguarded_crd())
    field = "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties[autoscaling].default"
    assert causes == [(field, 'Invalid value: "object": no such key: minReplicas evaluating rule: '
                              "autoscaling.minReplicas must be <= autoscaling.maxReplicas")]  # fmt: skip
    done = cluster.apply("-f", "-", stdin=yaml.safe_dump(_unguarded_crd()), check=False)
    assert done.returncode != 0
    assert 'The CustomResourceDefinition "brokens.broken.overlap.dev" is invalid' in done.stderr  # kubectl's words
    assert "no such key: minReplicas evaluating rule" in done.stderr


ROOT = "spec.versions[0].schema.openAPIV3Schema"


def _spec_level(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


@pytest.mark.parametrize(
    ("breakage", "field", "message"),
    [
        (lambda s: s["properties"]["replicas"].pop("type"), f"{ROOT}.properties[spec].properties[replicas].type",
         "Required value: must not be empty for specified object fields"),
        (lambda s: s["properties"]["images"]["properties"]["pullSecrets"].pop("items"),
         f"{ROOT}.properties[spec].properties[images].properties[pullSecrets].items",
         "Required value: must be specified"),
        (lambda s: s.update(additionalProperties={"type": "string"}), f"{ROOT}.properties[spec].additionalProperties",
         "Forbidden: additionalProperties and properties are mutual exclusive"),
        (lambda s: s["properties"]["sidecar"].update(default={"port": 8000, "colour": "blue"}),
         f"{ROOT}.properties[spec].properties[sidecar].default", "must not have unknown fields"),
        (lambda s: s["x-kubernetes-validations"].append({"rule": "self.replicas <"}),
         f"{ROOT}.properties[spec].x-kubernetes-validations[{len(_spec_level(CRD)['x-kubernetes-validations'])}].rule",
         "compilation failed: ERROR: <input>:1:"),
    ],
    ids=["no-type", "array-without-items", "properties-and-additionalProperties", "unknown-default-field",
         "cel-syntax"],
)  # fmt: skip
def test_a_crd_schema_the_api_server_refuses_is_refused_with_its_words(breakage, field, message) -> None:
    assert admission.crd_schema_errors(CRD) == []
    crd = copy.deepcopy(CRD)
    breakage(_spec_level(crd))
    causes = admission.crd_schema_errors(crd)
    assert [f for f, _ in causes] == [field] and message in causes[0][1], causes


def test_kubectl_apply_of_a_non_structural_crd_prints_the_refusal(cluster) -> None:
    crd = _unguarded_crd()
    _spec_level(crd)["properties"]["replicas"].pop("type")
    done = cluster.apply("-f", "-", stdin=yaml.safe_dump(crd), check=False)
    assert done.returncode != 0 and "must not be empty for specified object fields" in done.stderr


@pytest.mark.parametrize("name", ["llama-3.1-8b", "8b-llama", "Llama", "a" * 64, "llama-"])
def test_names_that_cannot_name_the_service_are_refused_by_the_crd_and_the_operator(name) -> None:
    obj = copy.deepcopy(VALID)
    obj["metadata"]["name"] = name
    assert "metadata.name must be a DNS-1035 label" in refusal(obj)
    with pytest.raises(specs.SpecError) as caught:
        specs.check_name(name)
    assert " ".join(refusal(obj).split()).endswith(str(caught.value))


@pytest.mark.parametrize("name", ["llama-3-1-8b", "m", "a" * 63])
def test_dns_1035_names_are_admitted(name) -> None:
    obj = copy.deepcopy(VALID)
    obj["metadata"]["name"] = name
    admission.admit(obj, SCHEMA, strict=True)
    specs.check_name(name)


@pytest.mark.reliability
def test_model_paths_that_leave_their_volume_are_refused_twice(reliability) -> None:
    """Each way out of the weights' volume, refused by the CRD's rules (what the API server admits) and by the
    operator (a CRD installed without them), with the same words."""
    for case in BAD_MODELS:
        model, message = case.values
        assert message in refusal(with_spec(model={"servedName": "llm", **model}))
        with pytest.raises(specs.SpecError, match=message.replace(".", r"\.")):
            specs.check_spec(specs.with_defaults(with_spec(model={"servedName": "llm", **model})["spec"]))
    reliability.row(
        "Security", "model paths that try to leave their volume: " + ", ".join(c.id for c in BAD_MODELS),
        load="one InferenceService each", outcome="each refused by the CRD's CEL rules and by the operator, with the "
        "same message (e.g. " + repr(BAD_MODELS[0].values[1]) + ")",
    )  # fmt: skip


@pytest.mark.parametrize("copy_of", ["crds", "charts/overlap/files/crds"])
def test_the_crds_live_knobs_are_the_engines_live_knobs(copy_of: str) -> None:
    """spec.engine's fields marked Live, status.liveKnobs and tuning.bounds against LiveKnobs (one definition):
    the same names (camelCased by the one function), types, and limits the engine accepts."""
    from overlap.engine.config import EngineConfig, LiveKnobs, camel_case
    from overlap.engine.errors import ConfigError

    crd = yaml.safe_load((REPO / copy_of / "inferenceservices.overlap.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    engine = schema["properties"]["spec"]["properties"]["engine"]["properties"]
    status = schema["properties"]["status"]["properties"]["liveKnobs"]["properties"]
    bounds = schema["properties"]["spec"]["properties"]["tuning"]["properties"]["bounds"]["properties"]
    names = {camel_case(name): name for name in LiveKnobs.names()}
    live = {key for key, field in engine.items() if field.get("description", "").endswith("Live.")}
    assert live == set(names) == set(status)
    assert set(bounds) == {camel_case(knob) for knob in specs.TUNABLE_KNOBS} and set(bounds) <= live
    kinds = {"int": "integer", "float": "number", "float | None": "number"}
    start = EngineConfig(num_buffers=2).live
    for key, name in names.items():
        kind = kinds[next(f.type for f in dataclasses.fields(LiveKnobs) if f.name == name)]
        assert engine[key]["type"] == status[key]["type"] == kind, key
        if "default" in engine[key]:
            assert engine[key]["default"] == getattr(start, name), key
        low, step = engine[key]["minimum"], 1 if kind == "integer" else 1e-3
        lowest = low + step if engine[key].get("exclusiveMinimum") else low
        assert getattr(start.replace(**{name: lowest}), name) == lowest, key  # the CRD's lowest value runs
        with pytest.raises(ConfigError):
            start.replace(**{name: lowest - step})  # and below it the engine refuses, as the API server does
        if "maximum" in engine[key]:
            start.replace(**{name: engine[key]["maximum"]})
