"""engine.speculative with method draft_model: the CRD's rules on its `model` uri (and the operator's, in the same
words), the pod's fetch container fetching the draft after the model, the engine reading the draft's link, and
ModelReady naming both. Checked without Kubernetes (the pod strictly against its schema)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from overlap.operator import children, status
from overlap.operator import spec as specs
from tests.support.kube import admission

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "crds" / "inferenceservices.overlap.dev.yaml").read_text())["spec"]["versions"][0][
    "schema"
]["openAPIV3Schema"]
OWNER = {
    "apiVersion": "overlap.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llm", "namespace": "ml", "uid": "0f6c1c1e-0000-4000-8000-000000000001", "generation": 1},
}
MODEL = {"servedName": "llm", "uri": "hf://Qwen/Qwen2.5-7B-Instruct", "secretRef": {"name": "hf"}}
DRAFT = {"method": "draft_model", "model": "hf://Qwen/Qwen2.5-0.5B-Instruct", "numSpeculativeTokens": 4}


def service(model: dict, speculative: dict) -> dict:
    return {"apiVersion": OWNER["apiVersion"], "kind": OWNER["kind"], "metadata": {"name": "llm"},
            "spec": {"model": copy.deepcopy(model), "engine": {"speculative": dict(speculative)}}}  # fmt: skip


def pod_of(model: dict, speculative: dict) -> tuple[dict, dict]:
    """(the pod spec, engine.json) the operator builds for a spec the CRD admitted."""
    stored = admission.admit(service(model, speculative), SCHEMA, strict=True)
    full = specs.with_defaults(stored["spec"])
    config = specs.check_spec(full)
    built = {o["kind"]: o for o in children.build_children(OWNER, full, config, with_servicemonitor=False)}
    kubernetes_validate.validate(built["Deployment"], kubernetes_validate.latest_version(), strict=True)
    return built["Deployment"]["spec"]["template"]["spec"], json.loads(built["ConfigMap"]["data"]["engine.json"])


def test_the_draft_is_fetched_after_the_model_by_the_same_fetch_container_and_the_engine_reads_its_link():
    pod, engine_json = pod_of(MODEL, DRAFT)
    (fetch,) = pod["initContainers"]
    assert fetch["args"] == ["model", "fetch", MODEL["uri"], "--cache-dir", specs.MODEL_CACHE_DIR, "--link",
                             specs.MODEL_LINK, "--draft", DRAFT["model"], "--draft-link", specs.DRAFT_LINK]  # fmt: skip
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf"}}]  # the same Secret for both
    assert engine_json["model"] == specs.MODEL_LINK
    assert engine_json["speculative_config"] == {"method": "draft_model", "num_speculative_tokens": 4,
                                                 "model": specs.DRAFT_LINK}  # fmt: skip
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}["model-link"] == specs.MODEL_LINK_DIR
    assert specs.DRAFT_LINK.startswith(specs.MODEL_LINK_DIR + "/")


@pytest.mark.parametrize(
    "model",
    [
        {"servedName": "llm", "path": "/models/llm"},
        {"servedName": "llm", "uri": "pvc://weights/llm"},
        {"servedName": "llm", "uri": "oci://ghcr.io/acme/llm:v1", "imageVolume": True, "secretRef": {"name": "reg"}},
    ],
    ids=["image-path", "pvc", "image-volume"],
)
def test_a_model_read_in_place_still_gets_its_draft_fetched(model):
    pod, engine_json = pod_of(model, {**DRAFT, "model": "oci://ghcr.io/acme/draft:v1"})
    (fetch,) = pod["initContainers"]
    assert fetch["args"] == ["model", "fetch", "--cache-dir", specs.MODEL_CACHE_DIR, "--draft",
                             "oci://ghcr.io/acme/draft:v1", "--draft-link", specs.DRAFT_LINK]  # fmt: skip
    if model.get("secretRef"):  # read as the draft's scheme reads it: a registry login
        assert {"name": "DOCKER_CONFIG", "value": specs.REGISTRY_CONFIG_DIR} in fetch["env"]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    names = {m["name"] for m in engine["volumeMounts"]}
    assert {"model-cache", "model-link"} <= names and ("model" in names) == ("path" not in model)
    assert engine_json["speculative_config"]["model"] == specs.DRAFT_LINK


BAD = [
    pytest.param(MODEL, {k: v for k, v in DRAFT.items() if k != "model"}, specs.DRAFT_MESSAGE, id="draft-no-model"),
    pytest.param(MODEL, {"method": "ngram", "numSpeculativeTokens": 4, "model": "hf://a/b"}, specs.DRAFT_MESSAGE,
                 id="ngram-with-model"),
    pytest.param(MODEL, {**DRAFT, "promptLookupMax": 3}, specs.LOOKUP_MESSAGE, id="draft-with-lookup"),
    pytest.param(MODEL, {**DRAFT, "model": "https://h.example/a/../d.tar"},
                 "engine.speculative.model must not hold '.' or '..' segments", id="draft-dot-dot"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "speculative", "message"), BAD)
def test_the_crd_and_the_operator_refuse_a_bad_draft_in_the_same_words(model, speculative, message):
    with pytest.raises(admission.Invalid, match=message.replace(".", r"\.")):
        admission.admit(service(model, speculative), SCHEMA, strict=True)
    with pytest.raises(specs.SpecError, match=message.replace(".", r"\.")):
        specs.check_spec(specs.with_defaults(service(model, speculative)["spec"]))


def test_a_draft_from_a_claim_is_refused_it_is_fetched_only():
    bad = service(MODEL, {**DRAFT, "model": "pvc://weights/draft"})
    with pytest.raises(admission.Invalid, match=r"spec\.engine\.speculative\.model in body should match"):
        admission.admit(bad, SCHEMA, strict=True)
    with pytest.raises(specs.SpecError, match="a pvc:// uri cannot be fetched"):
        specs.check_spec(specs.with_defaults(bad["spec"]))


def test_model_ready_names_the_model_and_its_draft_and_which_fetch_failed():
    assert specs.fetch_subject(service(MODEL, DRAFT)["spec"]) == f"{MODEL['uri']} with draft {DRAFT['model']}"
    in_place = {"servedName": "llm", "path": "/models/llm"}
    assert specs.fetch_subject(service(in_place, DRAFT)["spec"]) == f"draft {DRAFT['model']}"
    assert specs.fetch_subject({"model": in_place}) is None
    failed = {"name": "fetch", "state": {"terminated": {"exitCode": 1, "message": "draft model: hf://x/y: 404"}}}
    pod = {"metadata": {"name": "llm-0"}, "status": {"initContainerStatuses": [failed]}}
    subject = specs.fetch_subject(service(MODEL, DRAFT)["spec"])
    ready = status.model_condition([pod], "fetch", subject, "2026-12-06T00:00:00Z", 1)
    assert (ready["status"], ready["reason"]) == ("False", "FetchFailed")
    assert "pod llm-0: draft model: hf://x/y: 404" in ready["message"]
