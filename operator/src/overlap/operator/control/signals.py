"""The control loop's load signals, read from Prometheus's HTTP API (`GET /api/v1/query`).

Each signal is one PromQL query over the sidecars' `/metrics` (docs/sidecar.md lists the series). `$selector`
in a query expands to this service's label matchers: `namespace="NS",service="NAME"`, the labels a
ServiceMonitor scrape puts on every series (the operator creates one per service); `$window` to the rate window
of the latency signals. A spec can override any query (`spec.prometheus.queries`, with the same placeholders),
e.g. for a Prometheus that labels its targets differently.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from overlap.operator.control.policy import Signals
from overlap.operator.settings import DEFAULT_SIGNAL_WINDOW_S

# The trailing window of the rate-based signals (`$window` in a query): the operator's --signal-window-s
# (OperatorSettings.signal_window_s), and the tuner waits that long after a move (TuningPolicy.signal_window_s).
DEFAULT_WINDOW_S = DEFAULT_SIGNAL_WINDOW_S

DEFAULT_QUERIES: dict[str, str] = {
    "queueDepth": "sum(vllm:num_requests_waiting{$selector})",
    "deviceBusy": "avg(overlap_device_busy_ratio{$selector})",
    "queueTimeShare": (
        "sum(rate(overlap_request_queue_time_seconds_sum{$selector}[$window]))"
        " / sum(rate(overlap_e2e_request_latency_seconds_sum{$selector}[$window]))"
    ),
    "p99Latency": (
        "histogram_quantile(0.99, sum by (le) (rate(overlap_e2e_request_latency_seconds_bucket{$selector}[$window])))"
    ),
    "ttftP99": (
        "histogram_quantile(0.99, sum by (le) (rate(overlap_time_to_first_token_seconds_bucket{$selector}[$window])))"
    ),
    "kvCacheUsage": "max(vllm:kv_cache_usage_perc{$selector})",
    "arrivalRate": "sum(rate(overlap_requests_received_total{$selector}[$window]))",
    "finishRate": 'sum(rate(overlap_requests_finished_total{$selector,reason=~"stop|length"}[$window]))',
    "running": "sum(vllm:num_requests_running{$selector})",
    # the mean sequences per engine step over each engine's recent steps (steadier than `running`, which dips for
    # a step whenever a sequence finishes), averaged over the pods
    "batchSize": "avg(overlap_batch_size_avg{$selector})",
    "ttftP90": (
        "histogram_quantile(0.9, sum by (le) (rate(overlap_time_to_first_token_seconds_bucket{$selector}[$window])))"
    ),
    "itlP90": (
        "histogram_quantile(0.9, sum by (le) (rate(overlap_inter_token_latency_seconds_bucket{$selector}[$window])))"
    ),
    # pods whose last scrape succeeded (a failed scrape marks a target's series stale at once): the per-replica
    # figures are over these, so one failing scrape does not dilute (or block) the others
    "scrapedReplicas": "count(overlap_sidecar_inflight_requests{$selector})",
    # held by the activator, or by the router of a routed service, while no replica is ready
    "activatorQueue": 'sum({__name__=~"overlap_activator_queued_requests|overlap_router_held_requests",$selector})',
}
# spec.prometheus.queries key -> Signals field
SIGNAL_FIELDS = {
    "queueDepth": "queue_depth",
    "deviceBusy": "device_busy",
    "queueTimeShare": "queue_time_share",
    "p99Latency": "p99_latency_s",
    "ttftP99": "ttft_p99_s",
    "kvCacheUsage": "kv_cache_usage",
    "arrivalRate": "arrival_rate",
    "finishRate": "finish_rate",
    "running": "running",
    "batchSize": "batch_size",
    "ttftP90": "ttft_p90_s",
    "itlP90": "itl_p90_s",
    "scrapedReplicas": "scraped_replicas",
    "activatorQueue": "activator_queue",
}
TIMEOUT_S = 5.0
# A tick's queries go out at once (a slow Prometheus costs the tick one query's time, not one per signal), on
# threads shared by every service's tick.
_QUERIES = ThreadPoolExecutor(max_workers=32, thread_name_prefix="prometheus-query")


class PrometheusError(RuntimeError):
    """Prometheus could not be asked, or refused a query; the message says which and why."""


class PrometheusUnreachable(PrometheusError):
    """No answer at all (refused, timed out, not HTTP): Prometheus is down or unreachable, not one query wrong."""


def selector(namespace: str, name: str) -> str:
    return f'namespace="{namespace}",service="{name}"'


def queries_for(
    namespace: str, name: str, overrides: Mapping[str, str] | None = None, window_s: float = DEFAULT_WINDOW_S
) -> dict[str, str]:
    """Every signal's PromQL with `$selector` and `$window` expanded (overrides from the spec win)."""
    matchers, window = selector(namespace, name), f"{window_s:g}s"
    chosen = {**DEFAULT_QUERIES, **(overrides or {})}
    return {key: query.replace("$selector", matchers).replace("$window", window) for key, query in chosen.items()}


def query(base_url: str, promql: str, timeout_s: float = TIMEOUT_S) -> float | None:
    """An instant query's single value; None when it returns no series or NaN (no traffic yet)."""
    url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:  # 400: a bad query; Prometheus says why in the body
        try:
            detail = json.load(exc).get("error", exc.reason)
        except ValueError:
            detail = exc.reason
        raise PrometheusError(f"Prometheus refused {promql!r}: {exc.code} {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PrometheusUnreachable(f"cannot query Prometheus at {base_url}: {reason}") from exc
    except ValueError as exc:  # an answer that is not JSON: this query's, not the server's
        raise PrometheusError(f"Prometheus answered {promql!r} with no JSON: {exc}") from exc
    result = (body.get("data") or {}).get("result") or []
    if body.get("status") != "success" or not result:
        return None
    value = float(result[0]["value"][1])
    return None if value != value else value  # NaN (0/0 over an idle window): no reading


def read_signals(
    base_url: str, queries: Mapping[str, str], *, ready_replicas: int, now: float, timeout_s: float = TIMEOUT_S
) -> Signals:
    """One reading of every signal (expanded queries from `queries_for`), the queries sent at once. A query that
    fails leaves its signal out and names it in `stale`; PrometheusError when every query failed, or when one got
    no answer at all (Prometheus down or unreachable: the tick holds on no reading rather than on a part)."""
    values: dict[str, float | None] = {}
    failed: dict[str, PrometheusError] = {}
    answers = {key: _QUERIES.submit(query, base_url, promql, timeout_s) for key, promql in queries.items()}
    for key, answer in answers.items():
        try:
            values[SIGNAL_FIELDS[key]] = answer.result()
        except PrometheusUnreachable:
            raise
        except PrometheusError as exc:
            failed[key] = exc
    if failed and len(failed) == len(queries):
        raise next(iter(failed.values()))
    if values.get("scraped_replicas") is not None:
        values["scraped_replicas"] = round(values["scraped_replicas"])
    return Signals(time=now, ready_replicas=ready_replicas, stale=tuple(failed), **values)


def to_status(signals: Signals) -> dict[str, float]:
    """The CRD's status.signals: what the controller saw at its last tick (missing signals left out)."""
    fields = {
        "readyReplicas": signals.ready_replicas,
        "queueDepth": signals.queue_depth,
        "waitingPerReplica": signals.waiting_per_replica(),
        "deviceBusy": signals.device_busy,
        "queueTimeShare": signals.queue_time_share,
        "p99LatencySeconds": signals.p99_latency_s,
        "ttftP99Seconds": signals.ttft_p99_s,
        "kvCacheUsage": signals.kv_cache_usage,
        "arrivalRate": signals.arrival_rate,
        "finishRate": signals.finish_rate,
        "batchSize": signals.batch_size,
        "ttftP90Seconds": signals.ttft_p90_s,
        "itlP90Seconds": signals.itl_p90_s,
        "scrapedReplicas": signals.scraped_replicas,
        "activatorQueue": signals.activator_queue,
    }
    return {key: round(value, 4) for key, value in fields.items() if value is not None}
