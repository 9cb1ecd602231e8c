"""Prometheus metrics of the gateway (names prefixed ``rollout_gateway_``), the events ring
and the throughput history the status page draws.

Each app owns its registry, so several gateways (tests, benchmarks) can live in one
process. Gauges that mirror live state are read at scrape time by a collector instead of
being updated on the hot path. Every exported name is listed in docs/status-page.md.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                   300, 600)
RECONFIG_RESULTS = ("ok", "failed", "cancelled")
EVENT_KINDS = ("backend", "weight_version", "policy", "pause", "resume", "pool",
               "reconfiguration", "migration", "mismatch")


SCHEDULER_FAULT_STAGES = ("stale", "policy", "observe", "plan", "stall")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.calls = Counter("rollout_gateway_calls", "LLM calls answered, by endpoint and "
                             "status", ["endpoint", "status"], registry=r)
        self.tokens = Counter("rollout_gateway_tokens", "Tokens seen in answered calls",
                              ["kind"], registry=r)
        self.relayed_events = Counter(
            "rollout_gateway_relayed_events", "Upstream events of answered calls, by the "
            "relay path that captured them: fast (runs of plain token events, "
            "gateway/proxy/token_runs.py) or general; a fast share that drops after an "
            "engine upgrade means its stream changed shape", ["path"], registry=r)
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
        # Fed by the pool manager and the policies' driver as they land; exported from the
        # start (at zero) so dashboards and alerts can rely on the names.
        self.reconfigurations = Counter("rollout_gateway_reconfigurations", "Pool "
                                        "reconfiguration jobs finished, by result",
                                        ["result"], registry=r)
        self.reconfigurations_running = Gauge("rollout_gateway_reconfigurations_running",
                                              "Pool reconfiguration jobs in progress",
                                              registry=r)
        self.migrations = Counter("rollout_gateway_migrations", "Trajectories moved to another"
                                  " instance during a tool gap", registry=r)
        self.scheduler_faults = Counter(
            "rollout_gateway_scheduler_faults", "Scheduling faults by stage: calls failed "
            "because their trajectory was gone (stale) or the policy raised on them (policy), "
            "policy learning errors (observe, plan), and watchdog stalls (stall)", ["stage"],
            registry=r)
        for stage in SCHEDULER_FAULT_STAGES:
            self.scheduler_faults.labels(stage)
        for result in RECONFIG_RESULTS:
            self.reconfigurations.labels(result)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def add_collector(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.registry.register(_FnCollector(collect))


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterator[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterator[Metric]:
        return self._fn()


def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def sample_sum(metric: Counter | Histogram, suffix: str, **labels: str) -> float:
    """Sum of a metric's samples named ``<name><suffix>`` whose labels include ``labels``."""
    total = 0.0
    for family in metric.collect():
        for s in family.samples:
            if s.name == family.name + suffix and labels.items() <= s.labels.items():
                total += s.value
    return total


def histogram_quantile(metric: Histogram, q: float) -> float | None:
    """The ``q`` quantile of a histogram, interpolated inside its bucket (as PromQL does)."""
    buckets: list[tuple[float, float]] = []
    for family in metric.collect():
        buckets = [(float(s.labels["le"]), s.value) for s in family.samples
                   if s.name.endswith("_bucket")]
    if not buckets or buckets[-1][1] == 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = upper, count
    return lower


class EventLog(deque[dict[str, Any]]):
    """The last ``maxlen`` operational events (newest last), for the status page.

    Shape of one event: ``{"seq": int, "ts": epoch seconds, "kind": str, "message": str,
    **fields}``. Kinds in use: ``backend`` (added, removed, state or health changed),
    ``weight_version``, ``policy`` (both detected by the status monitor), ``pause``,
    ``resume``, ``pool`` (resize requested), ``reconfiguration`` (started/finished, with
    ``job`` and ``result``), ``migration`` (``trajectory``, ``source``, ``target``),
    ``mismatch`` (a trainer's mismatch report raised the alarm: ``step``, ``mode``,
    ``run_id``).
    Components call :meth:`emit`; ``counts`` keeps totals by kind beyond the ring.
    """

    def __init__(self, maxlen: int = 500) -> None:
        super().__init__(maxlen=maxlen)
        self.counts: Tally[str] = Tally()
        self._seq = itertools.count(1)

    def emit(self, kind: str, message: str, *, ts: float | None = None,
             **fields: Any) -> dict[str, Any]:
        event = {"seq": next(self._seq), "ts": time.time() if ts is None else ts,
                 "kind": kind, "message": message, **fields}
        self.append(event)
        self.counts[kind] += 1
        return event

    def recent(self, n: int) -> list[dict[str, Any]]:
        return list(itertools.islice(reversed(self), n))


@dataclass(frozen=True, slots=True)
class Point:
    """Cumulative counters and live gauges at one instant (epoch seconds)."""

    t: float
    calls: float
    prompt_tokens: float
    completion_tokens: float
    running: int
    queued: int
    finished: int


class History:
    """Points at a fixed interval over the whole run, in bounded memory.

    When ``capacity`` points are held, every other one is dropped and the stride doubles,
    so a long batch keeps its full extent at a coarser resolution.
    """

    def __init__(self, capacity: int = 720) -> None:
        self.capacity = max(4, capacity)
        self.points: list[Point] = []
        self.stride = 1
        self._ticks = 0

    def add(self, point: Point) -> None:
        self._ticks += 1
        if self.points and self._ticks % self.stride:
            return
        self.points.append(point)
        if len(self.points) >= self.capacity:
            self.points = self.points[::2]
            self.stride *= 2

    def rates(self) -> list[dict[str, float]]:
        """Per-interval rates between consecutive points (what the throughput chart draws)."""
        return [_rate(a, b) for a, b in itertools.pairwise(self.points)]

    def recent_rate(self, window_s: float, now: float) -> dict[str, float]:
        """Rates over (at least) the last ``window_s`` seconds; zeros with too few points."""
        pts: Sequence[Point] = self.points
        if len(pts) < 2:
            return {"t": now, "tokens_per_s": 0.0, "prompt_tokens_per_s": 0.0,
                    "calls_per_s": 0.0}
        start = next((p for p in reversed(pts[:-1]) if pts[-1].t - p.t >= window_s), pts[0])
        return _rate(start, pts[-1])


def _rate(a: Point, b: Point) -> dict[str, float]:
    dt = max(b.t - a.t, 1e-9)
    return {"t": b.t, "tokens_per_s": (b.completion_tokens - a.completion_tokens) / dt,
            "prompt_tokens_per_s": (b.prompt_tokens - a.prompt_tokens) / dt,
            "calls_per_s": (b.calls - a.calls) / dt}
