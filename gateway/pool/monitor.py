"""The status monitor: scrapes each backend's vLLM ``/metrics`` and samples the gateway.

Once a second (one task, owned by the app lifespan) it reads from every healthy backend
the engine gauges a status page needs (running and waiting requests, KV-cache use,
prefix-cache queries and hits, generated tokens), appends a point to the throughput
history, and turns changes it observes (backend added or removed, state or health
changed, weight version, placement policy) into events. Backends without a ``/metrics``
endpoint (any OpenAI-compatible server) are asked again only every ``MISSING_RETRY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.dispatch.backends import Backend
from gateway.loops import Periodic
from gateway.metrics import EVENT_KINDS, History, Point, sample_sum

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendRegistry
    from gateway.dispatch.dispatcher import Dispatcher
    from gateway.metrics import EventLog, GatewayMetrics
    from gateway.trajectories.tracker import Tracker

log = logging.getLogger(__name__)
MISSING_RETRY_S = 30.0
SCRAPE_TIMEOUT_S = 2.0

# vLLM sample names (counters carry ``_total`` in the exposition) -> EngineSample fields.
VLLM_SAMPLES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM < 0.10
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    # the engine's own decode clock: every token's time since the one before it (vLLM >=
    # 0.11), or the same histogram under its name before 0.11
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:time_per_output_token_seconds_sum": "tpot_sum",
    "vllm:time_per_output_token_seconds_count": "tpot_count",
}


@dataclass(slots=True)
class EngineSample:
    """One scrape of a vLLM server, summed over its engines and models."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    tpot_sum: float | None = None
    tpot_count: float | None = None

    @property
    def decode_clock(self) -> tuple[float, float] | None:
        """(seconds, tokens) the engine's decode has taken since it started, from its
        inter-token latency histogram (the older name where the newer is missing)."""
        if self.itl_sum is not None and self.itl_count is not None:
            return self.itl_sum, self.itl_count
        if self.tpot_sum is not None and self.tpot_count is not None:
            return self.tpot_sum, self.tpot_count
        return None


def parse_vllm_metrics(text: str) -> EngineSample:
    """Pick vLLM's engine metrics out of a Prometheus text exposition."""
    out = EngineSample()
    kv_parts: list[float] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            field = VLLM_SAMPLES.get(s.name)
            if field is None:
                continue
            if field == "kv_usage":
                kv_parts.append(s.value)
                continue
            current = getattr(out, field)
            setattr(out, field, s.value + (current or 0.0))
    if kv_parts:  # several engines (data parallel): report the mean fill
        out.kv_usage = sum(kv_parts) / len(kv_parts)
    return out


@dataclass(slots=True)
class EngineStats:
    """What the status page shows per backend, derived from consecutive scrapes."""

    sample: EngineSample
    at: float
    tokens_per_s: float | None = None
    prefix_hit_rate: float | None = None

    def as_json(self) -> dict[str, float | None]:
        s = self.sample
        return {"running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage,
                "tokens_per_s": self.tokens_per_s, "prefix_hit_rate": self.prefix_hit_rate,
                "scraped_at": self.at}


def derive(previous: EngineStats | None, sample: EngineSample, now: float) -> EngineStats:
    """Rates between two scrapes; the hit rate is cumulative (queries since start)."""
    stats = EngineStats(sample, now)
    if sample.prefix_queries:
        stats.prefix_hit_rate = (sample.prefix_hits or 0.0) / sample.prefix_queries
    if previous is not None and sample.generation_tokens is not None:
        before = previous.sample.generation_tokens
        dt = now - previous.at
        if before is not None and dt > 0 and sample.generation_tokens >= before:
            stats.tokens_per_s = (sample.generation_tokens - before) / dt
    return stats


class MonitorHost(Protocol):
    """What the monitor samples; ``gateway.runtime.Runtime`` is one.

    Backends (scraped over the shared session), trajectories, the placement policy and
    weight version it watches, the event log it writes to, the metrics it registers on.
    """

    @property
    def session(self) -> aiohttp.ClientSession: ...
    @property
    def registry(self) -> BackendRegistry: ...
    @property
    def tracker(self) -> Tracker: ...
    @property
    def dispatcher(self) -> Dispatcher: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def weight_version(self) -> str: ...


class Monitor:
    """Background sampler behind ``/status``, ``/status/stream`` and per-instance metrics."""

    def __init__(self, interval_s: float = 1.0, history_capacity: int = 720) -> None:
        self.interval_s = interval_s
        self.engines: dict[str, EngineStats] = {}
        self.history = History(history_capacity)
        self.started_at = time.time()
        self._missing: dict[str, float] = {}
        self._seen: dict[str, tuple[str, bool]] = {}
        self._watched: tuple[str, str] | None = None
        self._loop: Periodic | None = None

    def start(self, rt: MonitorHost) -> None:
        rt.metrics.add_collector(lambda: self.collect(rt))
        self.observe(rt, time.time())

        async def round_() -> None:
            await self.scrape_all(rt)
            self.observe(rt, time.time())

        self._loop = Periodic("status-monitor", round_, self.interval_s, logger=log)
        self._loop.start()

    async def close(self) -> None:
        if self._loop is not None:
            await self._loop.close()

    async def scrape_all(self, rt: MonitorHost) -> None:
        now = time.time()
        targets = [b for b in rt.registry
                   if b.healthy and now >= self._missing.get(b.id, 0.0)]
        for b in rt.registry:  # no metrics (in the back-off): its calls are timed whole
            if b.healthy and now < self._missing.get(b.id, 0.0):
                b.read_decode_clock(None)
        await asyncio.gather(*(self._scrape(rt.session, b) for b in targets))
        live = {b.id for b in rt.registry}
        for gone in self.engines.keys() - live:
            del self.engines[gone]

    async def _scrape(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        try:
            async with session.get(f"{backend.url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:  # no metrics: its calls are timed whole
                    self._missing[backend.id] = time.time() + MISSING_RETRY_S
                    backend.read_decode_clock(None)
                    return
                text = await resp.text()
            sample = parse_vllm_metrics(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("scrape of %s failed: %s", backend.url, exc)
            return
        backend.read_decode_clock(sample.decode_clock)
        self.engines[backend.id] = derive(self.engines.get(backend.id), sample, time.time())

    def observe(self, rt: MonitorHost, now: float) -> None:
        """Add a history point and turn observed changes into events."""
        m = rt.metrics
        running = sum(b.in_flight for b in rt.registry)
        queued = finished = 0
        for st in rt.tracker:
            queued += st.queued
            finished += st.finished_at is not None
        self.history.add(Point(
            t=now, calls=sample_sum(m.calls, "_total"),
            prompt_tokens=sample_sum(m.tokens, "_total", kind="prompt"),
            completion_tokens=sample_sum(m.tokens, "_total", kind="completion"),
            running=running, queued=queued, finished=finished))
        self._diff_backends(rt, now)
        watched = (rt.weight_version, rt.dispatcher.policy_name)
        if self._watched is not None and watched != self._watched:
            if watched[0] != self._watched[0]:
                rt.events.emit("weight_version", f"weight version {self._watched[0]} -> "
                               f"{watched[0]}", ts=now, version=watched[0])
            if watched[1] != self._watched[1]:
                rt.events.emit("policy", f"placement policy {self._watched[1]} -> "
                               f"{watched[1]}", ts=now, policy=watched[1])
        self._watched = watched

    def _diff_backends(self, rt: MonitorHost, now: float) -> None:
        seen = {b.id: (b.state.value, b.healthy) for b in rt.registry}
        first = not self._seen
        for bid, (state, healthy) in seen.items():
            before = self._seen.get(bid)
            if before is None:
                if not first:
                    rt.events.emit("backend", f"{bid} added ({state})", ts=now, backend=bid)
            elif before[0] != state:
                rt.events.emit("backend", f"{bid}: {before[0]} -> {state}", ts=now,
                               backend=bid, state=state)
            elif before[1] != healthy:
                word = "healthy" if healthy else "unhealthy"
                rt.events.emit("backend", f"{bid} is {word}", ts=now, backend=bid,
                               healthy=healthy)
        for bid in self._seen.keys() - seen.keys():
            rt.events.emit("backend", f"{bid} removed", ts=now, backend=bid)
        self._seen = seen

    def collect(self, rt: MonitorHost) -> Iterator[Metric]:
        """Per-instance engine gauges, the active policy and event totals."""
        labels = ["backend"]
        fams = {
            "running": GaugeMetricFamily("rollout_gateway_backend_running", "Requests running "
                                         "in the backend's engine (vLLM)", labels=labels),
            "waiting": GaugeMetricFamily("rollout_gateway_backend_waiting", "Requests waiting "
                                         "in the backend's engine (vLLM)", labels=labels),
            "kv_usage": GaugeMetricFamily("rollout_gateway_backend_kv_cache_usage", "KV-cache "
                                          "fill of the backend, 0-1 (vLLM)", labels=labels),
            "tokens_per_s": GaugeMetricFamily("rollout_gateway_backend_generation_tokens_per_"
                                              "second", "Tokens generated per second by the "
                                              "backend (vLLM)", labels=labels),
            "prefix_hit_rate": GaugeMetricFamily("rollout_gateway_backend_prefix_cache_hit_"
                                                 "ratio", "Prefix-cache hits / queries since "
                                                 "the backend started (vLLM)", labels=labels),
        }
        gpus = GaugeMetricFamily("rollout_gateway_backend_gpus", "GPUs held by the backend "
                                 "(its TP degree when the GPU list is unknown)", labels=labels)
        for b in rt.registry:
            gpus.add_metric([b.id], len(b.gpus) or (b.tp or 1))
            stats = self.engines.get(b.id)
            if stats is None:
                continue
            for key, value in stats.as_json().items():
                if key in fams and value is not None:
                    fams[key].add_metric([b.id], value)
        yield from fams.values()
        yield gpus
        policy = GaugeMetricFamily("rollout_gateway_policy_info", "1 for the active placement "
                                   "policy", labels=["policy"])
        policy.add_metric([rt.dispatcher.policy_name], 1.0)
        yield policy
        events = CounterMetricFamily("rollout_gateway_events", "Operational events (pauses, "
                                     "migrations, reconfigurations, backend changes) by kind",
                                     labels=["kind"])
        for kind in sorted(set(EVENT_KINDS) | rt.events.counts.keys()):
            events.add_metric([kind], rt.events.counts.get(kind, 0))
        yield events
