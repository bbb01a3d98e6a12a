"""How the operator copes with many InferenceServices in one namespace, as a table.

    PATH=$PWD/.tools/bin:$PATH .venv/bin/python -m tests.operator.many_services [--count 200]

The emulated API server (tests/support/kube) with the CRD applied by kubectl; `overlap operator` as a process
against it; COUNT InferenceServices created through the API at once. It reports how long until every one has its
Deployment and a status for its current generation, the operator's peak resident memory (VmHWM from
/proc/PID/status), and how many of the operator's list/watch requests for children carried a label selector.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.support.cluster import (
    CRD_FILE,
    NAMESPACE,
    OPERATOR_TOKEN,
    ApiThread,
    Cluster,
    running_operator,
    write_kubeconfig,
)

CHILDREN = {"configmaps", "services", "deployments", "poddisruptionbudgets", "pods"}


def body(index: int) -> dict:
    return {
        "apiVersion": "overlap.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"svc-{index:03d}"},
        "spec": {"model": {"servedName": f"m{index}", "path": "/models/m"}, "resources": {"gpus": 0}},
    }


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reconciled(cluster: Cluster) -> int:
    items = cluster.custom.list_namespaced_custom_object("overlap.dev", "v1alpha1", NAMESPACE, "inferenceservices")
    done = 0
    for item in items["items"]:
        status = item.get("status") or {}
        if status.get("observedGeneration") == item["metadata"]["generation"]:
            done += 1
    deployments = len(cluster.apps.list_namespaced_deployment(NAMESPACE).items)
    return min(done, deployments)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args()
    api_thread = ApiThread()
    try:
        with tempfile.TemporaryDirectory() as folder:
            folder = Path(folder)
            cluster = Cluster(api_thread, write_kubeconfig(folder / "kubeconfig", api_thread.url, NAMESPACE))
            cluster.apply("-f", str(CRD_FILE))
            with running_operator(cluster, folder, "--namespace", NAMESPACE, "--standalone") as operator:
                started = time.monotonic()
                for index in range(args.count):
                    cluster.custom.create_namespaced_custom_object(
                        "overlap.dev", "v1alpha1", NAMESPACE, "inferenceservices", body(index)
                    )
                created_s = time.monotonic() - started
                done, last_report = 0, 0.0
                while done < args.count and time.monotonic() - started < args.timeout_s:
                    done = reconciled(cluster)
                    if time.monotonic() - last_report > 5:
                        print(f"  {done}/{args.count} reconciled after {time.monotonic() - started:.0f} s",
                              file=sys.stderr, flush=True)  # fmt: skip
                        last_report = time.monotonic()
                    time.sleep(0.5)
                took_s = time.monotonic() - started
                rss = peak_rss_mib(operator.proc.pid)
            selected = total = 0
            calls: dict[str, int] = {}
            for request in list(cluster.api.request_log):
                if request.headers.get("Authorization") != f"Bearer {OPERATOR_TOKEN}" or request.resource is None:
                    continue
                method = str(request.method.value).upper()
                key = f"{method} {request.resource.plural}{'/' + request.subresource if request.subresource else ''}"
                calls[key] = calls.get(key, 0) + 1
                if method == "GET" and not request.name and request.resource.plural in CHILDREN:
                    total += 1
                    selected += "labelSelector" in request.params
    finally:
        api_thread.close()
    print("| figure | value |\n|---|---|")
    print(f"| InferenceServices | {args.count} (created in {created_s:.1f} s) |")
    print(f"| reconciled (Deployment + status of the current generation) | {done} in {took_s:.1f} s |")
    print(f"| operator peak RSS (VmHWM) | {rss:.0f} MiB |")
    print(f"| children list/watch requests with a label selector | {selected} of {total} |")
    busiest = ", ".join(f"{key} {n}" for key, n in sorted(calls.items(), key=lambda kv: -kv[1])[:8])
    print(f"| the operator's API calls, busiest first | {sum(calls.values())}: {busiest} |")
    return 0 if done == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
