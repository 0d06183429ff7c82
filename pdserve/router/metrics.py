"""The router's Prometheus metrics, rendered by prometheus_client from its live state.

    sample                                          read from
    pdserve:router_requests_total                   stats["requests_total"] (proxy.py)
    pdserve:router_failed_total                     stats["failed_total"]
    pdserve:router_aborted_total                    stats["aborted_total"]
    pdserve:router_migrated_total                   stats["migrated_total"]
    pdserve:router_stuck_total                      stats["stuck_total"]
    pdserve:router_shed_total                       stats["shed_total"]
    pdserve:router_in_flight{worker,role}           Worker.in_flight
    pdserve:router_worker_healthy{worker,role}      Worker.healthy (1 or 0)

A collector reads the values at scrape time, so the proxy's counters stay plain ints on
its hot path and the metrics can never drift from what /server_info shows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.router.workers import WorkerPool

_COUNTER_HELP = {
    "requests_total": "Generation requests the router accepted",
    "failed_total": "Generation requests that failed (a leg unreachable or answering an error)",
    "aborted_total": "Generation attempts aborted on their workers (client gone, failure)",
    "migrated_total": "Requests moved to another prefill/decode pair after a failure",
    "stuck_total": "Attempts given up on: decode unhealthy or silent past the stall timeout",
    "shed_total": "Requests refused with 503 because every worker of a kind was unhealthy or full",
}


class RouterCollector(Collector):
    def __init__(self, stats: Mapping[str, int], pool: WorkerPool) -> None:
        self.stats = stats
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        for key, value in self.stats.items():
            name = "pdserve:router_" + key.removesuffix("_total")  # the client adds _total
            yield CounterMetricFamily(name, _COUNTER_HELP.get(key, key), value=value)
        labels = ["worker", "role"]
        in_flight = GaugeMetricFamily(
            "pdserve:router_in_flight",
            "Requests a worker is serving for this router",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pdserve:router_worker_healthy", "1 while the worker answers /health", labels=labels
        )
        for w in self.pool.all:
            in_flight.add_metric([w.url, w.role], w.in_flight)
            healthy.add_metric([w.url, w.role], int(w.healthy))
        yield in_flight
        yield healthy


def registry(stats: Mapping[str, int], pool: WorkerPool) -> CollectorRegistry:
    """A registry of its own (several routers may share a process, as tests do)."""
    r = CollectorRegistry(auto_describe=False)
    r.register(RouterCollector(stats, pool))
    return r


def render(r: CollectorRegistry) -> bytes:
    return generate_latest(r)
