"""Prometheus metrics of one frontend (its own registry, so several apps can share a process).

Latency histograms are observed by the frontend per request. Engine-side values
are read from the latest `engine.stats()` snapshot at scrape time:

    metric                                  engine.stats() key(s)
    pdserve:num_running_reqs                running
    pdserve:num_queue_reqs                  queued
    pdserve:num_prealloc_queue_reqs         prealloc
    pdserve:num_transfer_queue_reqs         transfer
    pdserve:token_usage                     token_usage, else 1 - free_kv_pages / total_kv_pages
    pdserve:forward_busy_ratio              forward_busy_ratio
    pdserve:kv_transfer_seconds (summary)   kv_transfer_seconds_sum, kv_transfer_seconds_count
    pdserve:kv_transfer_bytes_total         kv_transfer_bytes
    pdserve:transfer_failed_total           transfer_failed
    pdserve:num_running_reqs_peak           running_peak
    pdserve:num_preempted_queue_reqs        preempted
    pdserve:preemptions_total               preemptions
    pdserve:recomputed_tokens_total         recomputed_tokens
    pdserve:spec_drafted_tokens_total       spec_drafted_tokens (decode, --speculative)
    pdserve:spec_accepted_tokens_total      spec_accepted_tokens
    pdserve:spec_acceptance_rate            spec_acceptance_rate
    pdserve:spec_steps_total                spec_steps
    pdserve:spec_lookups_total              spec_lookups
    pdserve:spec_empty_lookups_total        spec_empty_lookups
    pdserve:prefix_cache_hit_tokens_total   prefix_cache_hit_tokens (prefill)
    pdserve:prefix_cache_hit_rate           prefix_cache_hit_rate (prefill)
    pdserve:prefix_cache_evictions_total    prefix_cache_evictions (prefill)

A key the engine does not report is exported as 0.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

_GAUGES = {
    "num_running_reqs": ("running", "Requests in the running batch"),
    "num_queue_reqs": ("queued", "Requests waiting in the engine's queues"),
    "num_prealloc_queue_reqs": ("prealloc", "Decode: requests waiting for a row and KV"),
    "num_transfer_queue_reqs": ("transfer", "Decode: requests waiting for their KV"),
    "forward_busy_ratio": ("forward_busy_ratio", "Share of time the forward stream is busy"),
    "num_running_reqs_peak": ("running_peak", "Decode: the largest batch launched so far"),
    "num_preempted_queue_reqs": ("preempted", "Decode: preempted requests waiting to resume"),
    "prefix_cache_hit_rate": (
        "prefix_cache_hit_rate",
        "Prefill: share of prompt tokens whose KV the prefix cache held",
    ),
    "prefix_cache_pages": ("prefix_cache_pages", "Prefill: KV pages held by the prefix cache"),
    "spec_acceptance_rate": (
        "spec_acceptance_rate",
        "Decode: share of speculative draft tokens the model accepted",
    ),
}
_COUNTERS = {
    "preemptions": ("preemptions", "Decode: running requests preempted (KV pool full)"),
    "recomputed_tokens": ("recomputed_tokens", "Decode: KV tokens recomputed to resume"),
    "prefix_cache_hit_tokens": (
        "prefix_cache_hit_tokens",
        "Prefill: prompt tokens served from the prefix cache",
    ),
    "prefix_cache_evictions": ("prefix_cache_evictions", "Prefill: prefix-cache pages evicted"),
    "spec_drafted_tokens": ("spec_drafted_tokens", "Decode: speculative draft tokens verified"),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Decode: draft tokens the model accepted"),
    "spec_steps": ("spec_steps", "Decode: speculative (verifying) steps"),
    "spec_lookups": ("spec_lookups", "Decode: steps that looked for draft tokens"),
    "spec_empty_lookups": (
        "spec_empty_lookups",
        "Decode: steps that looked for draft tokens and found none",
    ),
}


def token_usage(stats: dict[str, float]) -> float:
    if "token_usage" in stats:
        return float(stats["token_usage"])
    total = stats.get("total_kv_pages", 0.0)
    return 1.0 - stats.get("free_kv_pages", 0.0) / total if total else 0.0


class _EngineStatsCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        for name, (key, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"pdserve:{name}", doc, value=s.get(key, 0.0))
        yield GaugeMetricFamily("pdserve:token_usage", "Share of KV pages in use", token_usage(s))
        yield SummaryMetricFamily(
            "pdserve:kv_transfer_seconds",
            "KV transfer time per request",
            count_value=int(s.get("kv_transfer_seconds_count", 0)),
            sum_value=s.get("kv_transfer_seconds_sum", 0.0),
        )
        yield CounterMetricFamily(
            "pdserve:kv_transfer_bytes", "KV bytes transferred", s.get("kv_transfer_bytes", 0.0)
        )
        yield CounterMetricFamily(
            "pdserve:transfer_failed", "Failed KV transfers", s.get("transfer_failed", 0.0)
        )
        for name, (key, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"pdserve:{name}", doc, s.get(key, 0.0))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Arrival to last output token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdserve:requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Output tokens", registry=r)
        self._engine = _EngineStatsCollector()
        r.register(self._engine)

    def render(self, engine_stats: dict[str, float]) -> bytes:
        """The exposition text, with engine gauges taken from `engine_stats`."""
        self._engine.stats = engine_stats
        return generate_latest(self.registry)
