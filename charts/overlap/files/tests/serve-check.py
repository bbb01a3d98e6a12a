"""`helm test`: create a small CPU InferenceService (the tiny model baked into the engine image), wait until it is
Ready, ask it for a completion through its Service, and delete it, also when stopped (Helm deletes the test pod past
its timeout: SIGTERM) or when an earlier run left it behind. Runs in the operator image (python and the kubernetes
client); in the cluster it uses its pod's ServiceAccount, elsewhere KUBECONFIG.

    python serve-check.py NAMESPACE [--timeout-s 240] [--base-url URL]
"""

import argparse
import json
import signal
import sys
import time
import urllib.request

import kubernetes

GROUP, VERSION, PLURAL = "overlap.dev", "v1alpha1", "inferenceservices"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("namespace")
    parser.add_argument("--name", default="overlap-helm-test")
    parser.add_argument("--timeout-s", type=float, default=240)
    parser.add_argument("--base-url", help="where the Service answers (default: its cluster DNS name)")
    args = parser.parse_args()
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    api = kubernetes.client.CustomObjectsApi()
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": args.name},
        "spec": {
            "model": {"servedName": "tiny", "path": "/models/tiny"},
            "resources": {"gpus": 0, "engine": {"cpu": "1", "memory": "2Gi"}},
            "engine": {"maxNumSeqs": 4, "maxSeqLen": 256, "maxNumBatchedTokens": 256},
            "sidecar": {"gracePeriodSeconds": 5},
        },
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` deletes the service
    _delete(api, args.namespace, args.name)  # what a killed earlier run left
    api.create_namespaced_custom_object(GROUP, VERSION, args.namespace, PLURAL, body)
    try:
        deadline, message = time.monotonic() + args.timeout_s, "no status yet"
        while time.monotonic() < deadline:
            status = api.get_namespaced_custom_object(GROUP, VERSION, args.namespace, PLURAL, args.name).get("status")
            ready = next((c for c in (status or {}).get("conditions") or [] if c["type"] == "Ready"), None)
            if ready is not None:
                message = f"{ready['reason']}: {ready['message']}"
                if ready["status"] == "True":
                    break
            time.sleep(2)
        else:
            print(f"{args.name} did not become Ready in {args.timeout_s:g} s ({message})", file=sys.stderr)
            return 1
        base = args.base_url or f"http://{args.name}.{args.namespace}.svc:8000"
        request = urllib.request.Request(
            f"{base}/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            tokens = json.loads(reply.read())["usage"]["completion_tokens"]
        print(f"{args.name}: Ready ({message}); a completion of {tokens} tokens through {base}")
        return 0 if tokens == 4 else 1
    finally:
        _delete(api, args.namespace, args.name)


def _delete(api, namespace: str, name: str) -> None:
    """Delete the test service and wait until it is gone (a new one of the same name cannot be made before)."""
    try:
        api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
        return
    for _ in range(30):
        try:
            api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
