"""Prometheus metrics of the sidecar, in a registry passed in.

Request-level series (histograms, counters) are recorded by the sidecar as requests finish; engine-level gauges
(the Gateway API inference extension's `vllm:` names, step time, batch size, ...) are read at scrape time from the
engine's latest stats by a custom Collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from overlap.engine.config import LiveKnobs

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        self.queue_time = histogram(
            "overlap_request_queue_time_seconds", "Time from engine arrival to first scheduling"
        )
        self.prefill_time = histogram(
            "overlap_request_prefill_time_seconds", "Time from first scheduling to first token"
        )
        self.ttft = histogram("overlap_time_to_first_token_seconds", "Time from HTTP arrival to the first token")
        self.itl = histogram("overlap_inter_token_latency_seconds", "Time between generated tokens", _ITL_BUCKETS)
        self.e2e = histogram("overlap_e2e_request_latency_seconds", "Time from HTTP arrival to the last token")
        self.prompt_tokens = Counter("overlap_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("overlap_generation_tokens", "Generated tokens", registry=registry)
        self.cached_prompt_tokens = Counter(
            "overlap_prompt_cached_tokens", "Prompt tokens of finished requests served from the prefix cache",
            registry=registry,
        )  # fmt: skip
        self.received = Counter(
            "overlap_requests_received",
            "Generations (one per choice) that arrived, before admission",
            registry=registry,
        )
        self.finished = Counter(
            "overlap_requests_finished", "Requests finished, by reason", ["reason"], registry=registry
        )
        self.rejected = Counter(
            "overlap_requests_rejected", "Requests refused before reaching the engine", ["reason"], registry=registry
        )
        # Labels bound once, so every series exists (at 0) from the first scrape.
        self.finished_by = {r: self.finished.labels(r) for r in ("stop", "length", "abort", "timeout", "error")}
        reasons = ("queued_requests", "queued_tokens", "inflight", "draining", "engine_unavailable", "invalid")
        self.rejected_by = {r: self.rejected.labels(r) for r in (*reasons, "unauthorized")}


class EngineCollector(Collector):
    """Engine gauges from the engine's latest stats (None while the engine is away: only `engine_up` 0)."""

    def __init__(self, get_stats: Callable[[], dict | None], get_sidecar_state: Callable[[], dict]) -> None:
        self._get_stats = get_stats
        self._get_sidecar_state = get_sidecar_state

    def collect(self):
        stats = self._get_stats()
        side = self._get_sidecar_state()
        yield GaugeMetricFamily("overlap_engine_up", "1 when the engine is connected", value=1 if stats else 0)
        yield GaugeMetricFamily("overlap_sidecar_queued_requests", "Admitted, not yet started", value=side["queued"])
        yield GaugeMetricFamily("overlap_sidecar_inflight_requests", "Admitted, unfinished", value=side["inflight"])
        if not stats:
            return

        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=float(stats.get(key) or 0))

        yield gauge("vllm:num_requests_waiting", "Requests waiting in the engine queue", "num_waiting")
        yield gauge("vllm:num_requests_running", "Requests in the running batch", "num_running")
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", "kv_usage")
        yield gauge("overlap_kv_cache_blocks", "KV blocks in the pool", "num_kv_blocks")
        yield gauge("overlap_step_time_seconds", "Duration of the last engine step", "last_step_time_s")
        yield gauge("overlap_step_time_avg_seconds", "Average engine step duration", "avg_step_time_s")
        yield gauge("overlap_batch_size", "Sequences in the last engine step", "last_batch_size")
        yield gauge("overlap_batch_size_avg", "Average sequences per engine step", "avg_batch_size")
        yield gauge(
            "overlap_device_busy_ratio",
            "Share of time the device is busy (measured by the runner)",
            "device_busy_ratio",
        )
        if stats.get("device_kernel_busy_ratio") is not None:  # CUDA, once a step was profiled
            yield gauge(
                "overlap_device_kernel_busy_ratio",
                "Share of time the device's kernels run (event-bracketed busy time x profiled kernel share)",
                "device_kernel_busy_ratio",
            )
        yield gauge(
            "overlap_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", "prefix_cache_hit_rate"
        )
        yield CounterMetricFamily(
            "overlap_preemptions", "Requests preempted", value=float(stats.get("num_preemptions_total") or 0)
        )
        yield CounterMetricFamily(
            "overlap_engine_prompt_tokens",
            "Prompt tokens the engine prefilled",
            value=float(stats.get("num_prompt_tokens_total") or 0),
        )
        yield CounterMetricFamily(
            "overlap_engine_generation_tokens",
            "Tokens the engine generated",
            value=float(stats.get("num_generation_tokens_total") or 0),
        )
        yield from _spec_decode_metrics(stats)
        yield from _lora_metrics(stats)
        for name, key, doc in (
            ("overlap_queue_depth", "num_waiting_by_priority", "Requests waiting in the engine, per priority"),
            ("overlap_running_requests", "num_running_by_priority", "Requests running in the engine, per priority"),
        ):
            family = GaugeMetricFamily(name, doc, labels=["priority"])
            for priority, value in _items(stats.get(key)):
                family.add_metric([str(priority)], float(value))
            yield family
        config = stats.get("config") or {}
        family = GaugeMetricFamily("overlap_engine_config", "The engine's live configuration knobs", labels=["knob"])
        for knob in LiveKnobs.names():
            value = config.get(knob)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family.add_metric([knob], float(value))
        yield family


def _lora_metrics(stats: dict):
    """vLLM's `vllm:lora_requests_info`: the adapters of running and waiting requests (comma-separated) and the slots,
    as labels; the value is when this was read (the Gateway API inference extension's lora-affinity scorer reads
    it). Only with LoRA enabled."""
    config = stats.get("config") or {}
    if not config.get("enable_lora"):
        return
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])  # fmt: skip
    labels = [str(config.get("max_loras", 0)), ",".join(stats.get("lora_waiting") or []),
              ",".join(stats.get("lora_running") or [])]  # fmt: skip
    family.add_metric(labels, time.time())
    yield family


def _spec_decode_metrics(stats: dict):
    """Speculative decoding's counters under vLLM's names, from an engine that speculates (none otherwise, as vLLM):
    verification steps, proposed tokens, accepted ones, and accepted ones by position in the step's proposals."""
    if not (stats.get("config") or {}).get("speculative_config"):
        return
    for name, key, doc in (
        ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts_total", "Steps that verified a sequence's proposals"),
        ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total", "Proposed tokens verified"),
        ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_total", "Proposed tokens accepted"),
    ):
        yield CounterMetricFamily(name, doc, value=float(stats.get(key) or 0))
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Proposed tokens accepted, by position among a step's proposals (0: the first)",
                                 labels=["position"])  # fmt: skip
    for position, value in _items(stats.get("spec_decode_num_accepted_tokens_per_pos")):
        family.add_metric([str(position)], float(value))
    yield family


def _items(value) -> list[tuple[object, float]]:
    """Per-priority figures arrive as a list (index = priority) or a dict."""
    if isinstance(value, dict):
        return sorted(value.items(), key=lambda kv: str(kv[0]))
    if isinstance(value, (list, tuple)):
        return list(enumerate(value))
    return []
