"""Prometheus metrics of the gateway (names prefixed ``rollout_gateway_``).

Each app owns its registry, so several gateways (tests, benchmarks) can live in one
process. Gauges that mirror live state are read at scrape time by a collector instead of
being updated on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                   300, 600)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.calls = Counter("rollout_gateway_calls", "LLM calls answered, by endpoint and "
                             "status", ["endpoint", "status"], registry=r)
        self.tokens = Counter("rollout_gateway_tokens", "Tokens seen in answered calls",
                              ["kind"], registry=r)
        self.retries = Counter("rollout_gateway_upstream_retries", "Calls retried on another "
                               "backend before their first byte", registry=r)
        self.queue_time = Histogram("rollout_gateway_queue_seconds", "Time a call waited in "
                                    "the gateway before dispatch", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.ttft = Histogram("rollout_gateway_time_to_first_token_seconds", "Time from "
                              "dispatch to the first streamed token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.duration = Histogram("rollout_gateway_call_seconds", "Total call time seen by the"
                                  " client", buckets=LATENCY_BUCKETS, registry=r)

    def add_collector(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.registry.register(_FnCollector(collect))


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterator[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterator[Metric]:
        return self._fn()


def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)
