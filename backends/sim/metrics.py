"""Prometheus metrics under vLLM's names, one registry per simulated server.

Gauges and token/prefix counters are read from the engine at scrape time (a custom
collector: nothing to update on the hot path); latency histograms are observed when a
request finishes. Times are *simulated* seconds, i.e. what a real vLLM would report.
TPOT (vllm:request_time_per_output_token_seconds) is observed once per request; the
inter-token latency (vLLM >= 0.11) is a sum and a count kept by the engine loop, exposed
with the ``+Inf`` bucket only.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from backends.sim.driver import RequestHandle, SimEngine

_TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, engine: SimEngine, model: str) -> None:
        self._engine = engine
        self._model = model

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def collect(self) -> Iterator[Metric]:
        core = self._engine.core
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          core.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          core.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                          core.kv_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up.",
                            core.kv.queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found cached.",
                            core.kv.hits)
        yield self._counter("vllm:num_preemptions", "Preemptions (recompute).",
                            core.num_preemptions)
        itl = HistogramMetricFamily("vllm:inter_token_latency_seconds",
                                    "Histogram of inter-token latency in seconds.",
                                    labels=["model_name"])
        itl.add_metric([self._model], [("+Inf", float(self._engine.itl_count))],
                       self._engine.itl_sum)
        yield itl


class ServerMetrics:
    """The registry of one server plus the hooks that feed it."""

    def __init__(self, engine: SimEngine, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine, model))
        labels = {"model_name": model}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.",
                                     ["model_name"], registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.",
                                         ["model_name"], registry=self.registry).labels(**labels)
        self.requests_success = Counter("vllm:request_success", "Finished requests.",
                                         ["model_name", "finished_reason"],
                                         registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=_TTFT_BUCKETS,
                              registry=self.registry).labels(**labels)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time per output token of a request.", ["model_name"],
                              buckets=_TPOT_BUCKETS, registry=self.registry).labels(**labels)
        self._model = model

    def on_finished(self, handle: RequestHandle) -> None:
        """Driver hook: one finished request's tokens and latencies."""
        self.prompt_tokens.inc(len(handle.request.prompt_ids))
        self.generation_tokens.inc(handle.num_generated)
        reason = handle.finish.value if handle.finish else "unknown"
        self.requests_success.labels(model_name=self._model, finished_reason=reason).inc()
        if handle.first_token_at is None:
            return
        self.ttft.observe(handle.first_token_at - handle.arrival)
        if handle.finished_at is not None and handle.num_generated > 1:
            self.tpot.observe((handle.finished_at - handle.first_token_at)
                              / (handle.num_generated - 1))
