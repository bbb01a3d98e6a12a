"""`overlap operator`: run the InferenceService operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "operator", help="run the Kubernetes operator for InferenceService objects (overlap.dev/v1alpha1)"
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", metavar="NS", help="watch this namespace (repeatable; default: all)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone",
        action="store_true",
        default=True,
        help="no peering with other operator replicas (the default: run one replica, Recreate strategy)",
    )
    peering.add_argument("--peering", metavar="NAME", help="coordinate with peers via this KopfPeering object")
    parser.add_argument(
        "--liveness", metavar="URL", help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port (/metrics)"
    )
    parser.add_argument(
        "--prometheus-url",
        metavar="URL",
        help="Prometheus the control loop queries when a spec names none (env OVERLAP_PROMETHEUS_URL)",
    )
    parser.add_argument(
        "--signal-window-s",
        type=float,
        metavar="S",
        help="rate window of the latency signals; the tuner also waits this long after a move (default 60; "
        "env OVERLAP_SIGNAL_WINDOW_S)",
    )
    parser.add_argument(
        "--api-timeout-s",
        type=float,
        metavar="S",
        help="give up on an API request after this long and retry it (default 30; env OVERLAP_API_TIMEOUT_S)",
    )
    parser.add_argument(
        "--resync-s",
        type=float,
        metavar="S",
        help="put every service's children right this often, whatever the events said (default 60; env "
        "OVERLAP_RESYNC_S)",
    )
    parser.add_argument(
        "--model-image",
        metavar="IMAGE",
        help="engine and sidecar image of services that name none (default: this operator's version; env "
        "OVERLAP_MODEL_IMAGE)",
    )
    parser.add_argument(
        "--crd-wait-s",
        type=float,
        default=300,
        metavar="S",
        help="how long to wait at start for the InferenceService CRD to be served before exiting 1 (default 300)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port (default 0.0.0.0)")
    parser.set_defaults(func=_run_operator)


def _run_operator(args: argparse.Namespace) -> int:
    from overlap.operator.settings import MEMO_KEY, OperatorSettings, SettingsError

    try:
        settings = OperatorSettings.from_args(args, os.environ)  # the only read of the environment's settings
    except SettingsError as exc:
        raise SystemExit(f"overlap operator: {exc}") from None

    import kopf

    from overlap.operator import handlers, kube  # noqa: F401 (importing handlers registers them)
    from overlap.operator.control import loop  # noqa: F401 (registers the control loop's timer)

    _wait_for_the_crd(kube, args.crd_wait_s, settings.api_timeout_s)
    if args.metrics_port:
        import prometheus_client

        prometheus_client.start_http_server(args.metrics_port, addr=args.metrics_host)

    kopf.run(
        standalone=args.peering is None,
        peering_name=args.peering,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo({MEMO_KEY: settings}),  # every handler's `settings_of(memo)`
    )
    return 0


def _wait_for_the_crd(kube, wait_s: float, api_timeout_s: float) -> None:
    """Start only once the API server serves InferenceServices: kopf would otherwise sit idle, its liveness probe
    passing, and never notice the CRD installed later. Logs why it waits; exits 1 after `wait_s` (kubelet restarts
    the pod, and CrashLoopBackOff says something is missing)."""
    import logging
    import time

    from overlap.operator.identity import GROUP, PLURAL

    log = logging.getLogger("overlap.operator")
    kube.configure(api_timeout_s)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if kube.serves_inference_services():
                return
            why = f"the InferenceService CRD ({PLURAL}.{GROUP}) is not installed"
        except Exception as exc:  # the API server not reachable yet: the same wait
            why = f"the API server did not answer API discovery ({exc})"
        if time.monotonic() >= deadline:
            raise SystemExit(f"overlap operator: {why} after {wait_s:g} s; install it (helm install, or kubectl apply "
                             "-f crds/) and the operator starts")  # fmt: skip
        log.warning("%s; waiting for it (helm install, or kubectl apply -f crds/)", why)
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
