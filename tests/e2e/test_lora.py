"""spec.adapters on podman pods behind the router (`make e2e`): two LoRA adapters, made by PEFT on the tiny model,
served from the loopback hub to 2 replicas; a third added to the list is fetched and loaded into the running pods
(same pods, no container restarted); each adapter's requests through the router reach a replica that serves it,
with PEFT's tokens for that adapter, and the router's hit share (overlap_router_adapter_requests_total{loaded})
goes into the report (e2e-report/lora.md)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import NAMESPACE, REPO, Cluster, wait_for
from tests.support.hub_node import hub_node, model_files, service_yaml
from tests.support.lora import cached_adapter, peft_greedy_each
from tests.support.node_agent import NodeAgent
from tests.support.sidecar import http, metric_value

pytestmark = pytest.mark.e2e
REPORT = REPO / "e2e-report" / "lora.md"
PROMPT = [5, 17, 300, 42, 9, 1200, 77]
NEW_TOKENS = 8
ROUNDS = 4
# name: make_adapter's settings (rank, alpha, rsLoRA, target modules, seed); each a repository on the hub
ADAPTERS = {
    "sql": (8, 16, False, ["q_proj", "v_proj", "down_proj"], 1),
    "chat": (4, 8, True, ["k_proj", "o_proj", "up_proj"], 2),
    "math": (8, 8, False, ["q_proj", "gate_proj"], 3),
}


@pytest.fixture(scope="module")
def lora_node(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[dict]:
    folders = {name: cached_adapter(tiny_model_dir, name, *settings) for name, settings in ADAPTERS.items()}
    repos = {"acme/tiny": model_files(tiny_model_dir)}
    repos.update({f"acme/{name}-lora": model_files(folder) for name, folder in folders.items()})
    # the default resync: an adapter fetched after the list changed is loaded by the pass retried while it waits
    with hub_node(tmp_path_factory.mktemp("lora"), repos) as node:
        yield {**node, "adapters": folders, "model_dir": tiny_model_dir}


def _listed(*names: str) -> list[dict]:
    return [{"name": name, "uri": f"hf://acme/{name}-lora"} for name in names]


def _engine_pods(cluster: Cluster, agent: NodeAgent, name: str) -> dict[str, tuple[str, dict[str, int]]]:
    """{pod: (uid, {container: restarts})} of the service's engine pods (not the router's)."""
    pods = {}
    for pod in [p for p in agent.pods.values() if p.deployment == name and not p.terminating]:
        read = cluster.core.read_namespaced_pod(pod.name, NAMESPACE)
        restarts = {c.name: c.restart_count for c in read.status.container_statuses or []}
        pods[pod.name] = (read.metadata.uid, restarts)
    return pods


def _loaded_everywhere(cluster: Cluster, name: str, pods: list[str], adapters: list[str]) -> bool:
    entries = (cluster.service(name).get("status") or {}).get("adapters") or []
    loaded = {(e["name"], e["pod"]) for e in entries if e["state"] == "Loaded"}
    return all((adapter, pod) in loaded for adapter in adapters for pod in pods)


def test_adapters_load_into_running_pods_and_the_router_keeps_each_on_a_replica_holding_it(lora_node):
    cluster, agent, model_dir = lora_node["cluster"], lora_node["agent"], lora_node["model_dir"]
    name = "lora"
    body = service_yaml(name, "hf://acme/tiny", lora_node, 2, adapters=_listed("sql", "chat"),
                        routing={"mode": "prefix"})  # fmt: skip
    cluster.apply("-f", "-", stdin=body)
    marks = {"applied": time.monotonic()}
    try:
        wait_for(lambda: cluster.service(name).get("status", {}).get("readyReplicas") == 2, 240,
                 "2 replicas to serve", interval=1)  # fmt: skip
        marks["ready"] = time.monotonic()
        before = _engine_pods(cluster, agent, name)
        assert len(before) == 2, before
        wait_for(lambda: _loaded_everywhere(cluster, name, list(before), ["sql", "chat"]), 60,
                 "sql and chat loaded on both replicas", interval=1)  # fmt: skip
        marks["loaded"] = time.monotonic()
        generation = cluster.apps.read_namespaced_deployment(name, NAMESPACE).metadata.generation

        # a third adapter: the ConfigMap reaches the pods, their adapters container fetches it, the operator loads it
        cluster.apply("-f", "-", stdin=service_yaml(name, "hf://acme/tiny", lora_node, 2, routing={"mode": "prefix"},
                                                    adapters=_listed("sql", "chat", "math")))  # fmt: skip
        listed = time.monotonic()
        wait_for(lambda: _loaded_everywhere(cluster, name, list(before), ["math"]), 150,
                 "math loaded on both replicas", interval=1)  # fmt: skip
        marks["third"] = time.monotonic()
        third_s = marks["third"] - listed
        assert _engine_pods(cluster, agent, name) == before  # the same pods, no container restarted
        assert cluster.apps.read_namespaced_deployment(name, NAMESPACE).metadata.generation == generation

        host, port = agent.service_address(name)
        url = f"http://{host}:{port}"
        wait_for(lambda: {"sql", "chat", "math"} <= {m["id"] for m in http("GET", f"{url}/v1/models")[2]["data"]},
                 30, "the router to list the three adapters", interval=0.5)  # fmt: skip

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        folders = {"tiny": None, **lora_node["adapters"]}
        greedy = peft_greedy_each(model_dir, folders, [PROMPT], NEW_TOKENS)
        expected = {model: tokenizer.decode(tokens[0], skip_special_tokens=True) for model, tokens in greedy.items()}
        assert len(set(expected.values())) == len(expected), expected  # each adapter changes the tokens
        marks["peft"] = time.monotonic()
        texts: dict[str, list[str]] = {model: [] for model in folders}
        for _ in range(ROUNDS):
            for model in folders:
                request = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                           "ignore_eos": True}  # fmt: skip
                status, _, out = http("POST", f"{url}/v1/completions", request, timeout=60)
                assert status == 200 and out["model"] == model, out  # a replica without the adapter answers 404
                texts[model].append(out["choices"][0]["text"])
        assert texts == {model: [text] * ROUNDS for model, text in expected.items()}

        marks["requests"] = time.monotonic()
        steps = list(marks.items())
        print("lora e2e:", ", ".join(f"{k} +{t - p:.1f} s" for (_, p), (k, t) in itertools.pairwise(steps)))
        metrics = http("GET", f"{url}/metrics")[2]
        hits = metric_value(metrics, "overlap_router_adapter_requests_total", 'loaded="true"') or 0
        misses = metric_value(metrics, "overlap_router_adapter_requests_total", 'loaded="false"') or 0
        adapter_requests = ROUNDS * len(ADAPTERS)
        assert hits + misses == adapter_requests
        assert misses <= len(ADAPTERS), (hits, misses)  # at most each adapter's first request finds it nowhere
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.write_text(
            "| figure | value |\n|---|---|\n"
            f"| replicas behind the router | {len(before)} |\n"
            f"| adapters at start, from the hub | sql, chat |\n"
            f"| third adapter (math) listed to loaded on every replica (s) | {third_s:.1f} |\n"
            "| pods replaced, containers restarted by it | 0, 0 |\n"
            f"| requests through the router per adapter (and base) | {ROUNDS} |\n"
            "| responses with PEFT's tokens for the model named | all |\n"
            f'| adapter hit share (loaded="true" of {adapter_requests}) | {hits / adapter_requests:.2f} |\n'
        )
    finally:
        cluster.kubectl("delete", "inferenceservice", name)
