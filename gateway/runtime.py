"""The gateway's live resources, opened by the app lifespan and closed in reverse.

Routes reach the runtime through ``request.state.rt`` (Starlette lifespan state), never
through module globals, so several gateways can run in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.core import CounterMetricFamily, Metric
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.adapters import Adapters
from gateway.config import Settings
from gateway.dispatch.backends import Backend, BackendRegistry, HealthChecker, parse_backend_spec
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.prewarm import prewarm
from gateway.dispatch.scheduler import Scheduler
from gateway.dispatch.speeds import speeds_for
from gateway.failure_log import FailureLog
from gateway.http_session import make_session
from gateway.live_calls import LiveCalls
from gateway.metrics import EventLog, GatewayMetrics, gauge
from gateway.mismatch import MismatchBoard, mismatch_limits
from gateway.policies.base import Migrate, Relayout
from gateway.policies.registry import get_policy
from gateway.pool.jobs import Job, JobBook
from gateway.pool.layout import LayoutError
from gateway.pool.manager import PoolManager, open_pool
from gateway.pool.monitor import Monitor
from gateway.pool.relayouts import RelayoutLog
from gateway.schema.mismatch import MismatchLimits
from gateway.store.db import is_sqlite, make_engine, make_sessionmaker, upgrade
from gateway.store.ledger import LOSS_REASONS
from gateway.store.quarantine import KINDS
from gateway.store.retention import RoutesRetention
from gateway.store.route_files import SEGMENT_AGE_S, RouteFiles, default_routes_dir
from gateway.store.spool import Spool, open_spools
from gateway.store.writer import TraceWriter
from gateway.token_text import TokenText
from gateway.trajectories.expiry import Expiry
from gateway.trajectories.restore import Restorer
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tracker import Tracker

#: what a gateway takes over from a backend it (re)admits: None to admit it, else why not
Adopt = Callable[["Runtime", Backend, object, aiohttp.ClientSession], Awaitable[str | None]]
log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    session: aiohttp.ClientSession
    registry: BackendRegistry
    health: HealthChecker
    dispatcher: Dispatcher
    tracker: Tracker
    writer: TraceWriter
    metrics: GatewayMetrics
    weight_version: str
    restorer: Restorer
    ready: bool = True
    #: the weight version was taken from an engine's label (``gateway.weights.adopt``)
    version_adopted: bool = False
    #: calls with an upstream request open, by engine: what a weight update waits on
    live_calls: LiveCalls = field(default_factory=LiveCalls)
    #: the LoRA families and adapters calls run on, by model name (``gateway.weights.lora``)
    adapters: Adapters = field(default_factory=Adapters)
    #: the staleness bound in weight versions (``PUT /admin/staleness``; None: no bound)
    max_staleness: int | None = None
    #: a model's own bound, where one was set (``PUT /admin/staleness`` with ``model``)
    model_staleness: dict[str, int] = field(default_factory=dict)
    #: weight-update jobs waiting for the trainer's push to end, by job id
    trainer_pushes: dict[str, asyncio.Event] = field(default_factory=dict)
    failure_log: FailureLog = field(default_factory=FailureLog)  # one line per failed call
    events: EventLog = field(default_factory=EventLog)
    monitor: Monitor = field(default_factory=Monitor)
    jobs: JobBook = field(default_factory=JobBook)
    relayouts: RelayoutLog = field(default_factory=RelayoutLog)  # the policy's proposals
    pool: PoolManager | None = None  # the managed pool (``settings.pool``), if any
    #: the trainers' training-inference mismatch reports (``POST /training/mismatch``)
    mismatch: MismatchBoard = field(default_factory=lambda: MismatchBoard(MismatchLimits()))
    #: token pieces the viewer shows, decoded by the engines (``GET .../view``)
    token_text: TokenText = field(default_factory=TokenText)
    #: clears routed experts past ``traces.routes_retention_s`` (None: kept, or not the
    #: shard that owns the store's upkeep)
    routes_retention: RoutesRetention | None = None

    def version_of(self, model: str) -> str:
        """The weight version a call for ``model`` (a served model or a LoRA family) is
        served on now: its family's current adapter's; a family before its first adapter
        runs on its base's weights, of the version they had when adapters were first
        loaded on them (a base's weights are fixed from then on)."""
        if (adapter := self.adapters.current(model)) is not None:
            return adapter.version
        if (base := self.adapters.base_of(model)) is not None:
            return self.adapters.base_versions.get(base, self.weight_version)
        return self.weight_version

    def model_names(self, by_model: dict[str, list[TrajectoryState]]) -> list[str]:
        """Every model calls may ask for or have asked for: served ones, LoRA families,
        and those of live trajectories (``by_model``: :meth:`Tracker.by_model`)."""
        return sorted(self.registry.known_models() | self.adapters.families.keys()
                      | by_model.keys())

    def bound_for(self, model: str) -> int | None:
        """The staleness bound ``model``'s tokens are held to (its own, else the
        gateway's)."""
        return self.model_staleness.get(model, self.max_staleness)

    def registry_mark_down(self, backend: Backend) -> None:
        """A call could not reach ``backend``: take it out of rotation until it recovers."""
        backend.last_error = "connection refused"
        if backend.healthy:
            log.warning("backend %s (%s) unreachable; out of rotation", backend.id, backend.url)
        backend.healthy = False

    def collect(self) -> Iterator[Metric]:
        inflight = gauge("rollout_gateway_backend_in_flight", "Calls in flight per backend",
                         ["backend", "tp"])
        healthy = gauge("rollout_gateway_backend_healthy", "1 if the backend is in rotation",
                        ["backend"])
        for b in self.registry:
            inflight.add_metric([b.id, str(b.tp or 1)], b.in_flight)
            healthy.add_metric([b.id], 1.0 if b.routable else 0.0)
        yield inflight
        yield healthy
        phases = gauge("rollout_gateway_trajectories", "Live trajectories by phase", ["phase"])
        counts: dict[str, int] = {}
        for st in self.tracker:
            counts[st.phase.value] = counts.get(st.phase.value, 0) + 1
        for phase in ("queued", "generating", "tool", "finished"):
            phases.add_metric([phase], counts.get(phase, 0))
        yield phases
        yield from self._model_metrics()
        yield _single("rollout_gateway_trace_queue_depth", "Trace records waiting to be "
                      "written", self.writer.queue_depth)
        yield from trace_metrics(self.writer, self.routes_retention)

    def _model_metrics(self) -> Iterator[Metric]:
        """Per model calls ask for (a served model, a LoRA family): its live trajectories
        by phase and, where it is an integer, its weight version."""
        load = gauge("rollout_gateway_model_trajectories", "Live trajectories by the model "
                     "of their latest call, and phase", ["model", "phase"])
        version = gauge("rollout_gateway_model_weight_version", "The weight version calls "
                        "for each model are served on (integer versions only)", ["model"])
        by_model = self.tracker.by_model()
        for name in self.model_names(by_model):
            counts: dict[str, int] = {}
            for st in by_model.get(name, []):
                counts[st.phase.value] = counts.get(st.phase.value, 0) + 1
            for phase in ("queued", "generating", "tool"):
                load.add_metric([name, phase], counts.get(phase, 0))
            if (v := self.version_of(name)).isdigit():
                version.add_metric([name], float(v))
        yield load
        yield version


def _single(name: str, doc: str, value: float) -> Metric:
    g = gauge(name, doc)
    g.add_metric([], value)
    return g


def trace_metrics(writer: TraceWriter, retention: RoutesRetention | None = None
                  ) -> Iterator[Metric]:
    """The trace writer's state and counters (docs/status-page.md lists them)."""
    yield _single("rollout_gateway_trace_dropped", "Trace records lost, whatever the reason "
                  "(rollout_gateway_trace_lost_total says which)", writer.dropped)
    lost = CounterMetricFamily("rollout_gateway_trace_lost", "Trace records in neither the "
                               "database, the spool nor the quarantine, by reason",
                               labels=["reason"])
    for reason in sorted(set(LOSS_REASONS) | set(writer.lost)):
        lost.add_metric([reason], writer.lost[reason])
    yield lost
    routes = CounterMetricFamily("rollout_gateway_trace_routes_dropped", "Trace records "
                                 "whose routed experts were left out (the writer behind); "
                                 "their tokens were kept")
    routes.add_metric([], writer.routes_dropped)
    yield routes
    unwritten = CounterMetricFamily("rollout_gateway_trace_routes_unwritten", "Trace records "
                                    "whose routed experts the segment files refused (a full "
                                    "or failing disk); their tokens were kept")
    unwritten.add_metric([], writer.routes_unwritten)
    yield unwritten
    cleared = CounterMetricFamily("rollout_gateway_trace_routes_cleared", "Calls whose "
                                  "routed experts this process cleared past "
                                  "traces.routes_retention_s (their tokens were kept)")
    cleared.add_metric([], retention.dropped if retention is not None else 0)
    yield cleared
    quarantined = CounterMetricFamily("rollout_gateway_trace_quarantined", "Trace records "
                                      "set aside in the quarantine file, by kind",
                                      labels=["kind"])
    counts = writer.quarantine.counts if writer.quarantine is not None else {}
    for kind in KINDS:
        quarantined.add_metric([kind], counts.get(kind, 0))
    yield quarantined
    restarts = CounterMetricFamily("rollout_gateway_trace_writer_restarts", "Times the trace "
                                   "writer's loop failed and was restarted")
    restarts.add_metric([], writer.restarts)
    yield restarts
    yield _single("rollout_gateway_trace_recording", "1 while the gateway records every call "
                  "it answers; 0 while it refuses model calls because it could not (the "
                  "writer down, or its memory full)", 0.0 if writer.refusal else 1.0)
    yield _single("rollout_gateway_trace_written", "Trace records written", writer.written)
    yield _single("rollout_gateway_trace_spool_bytes", "Bytes of trace records spooled "
                  "to disk while the database is unreachable", writer.spool_bytes)


def apply_relayout(rt: Runtime, change: Relayout, *, at_push: bool = False
                   ) -> tuple[Job | None, str]:
    """A policy's relayout handed to the managed pool (``at_push``: by the weight update
    that asks, :mod:`gateway.weights.relayout`), recorded for ``/status`` and announced:
    the job applying it, or None, and what became of it."""
    job, outcome = None, "no managed pool to apply it"
    if rt.pool is not None:
        try:
            job = rt.pool.relayout(change.retire, change.launch, change.reason,
                                   at_push=at_push)
            outcome = f"applying as job {job.id}"
        except LayoutError as exc:
            outcome = f"not applied: {exc}"
    rt.relayouts.record(time.time(), change.retire, change.launch, change.reason,
                        job=job, refused=None if job is not None else outcome)
    rt.events.emit("relayout", f"{'at the weight push, ' if at_push else ''}policy proposes "
                   f"retiring {list(change.retire)} for TP {list(change.launch)} "
                   f"({change.reason}); {outcome}",
                   retire=list(change.retire), launch=list(change.launch))
    return job, outcome


def wire_scheduler(rt: Runtime, scheduler: Scheduler) -> None:
    """Connect the scheduler's decisions to the resources that carry them out."""
    tasks: set[asyncio.Task[bool]] = set()

    def kv(backend_id: str) -> float | None:
        stats = rt.monitor.engines.get(backend_id)
        return stats.sample.kv_usage if stats is not None else None

    def migrate(state: TrajectoryState, move: Migrate) -> None:
        target = rt.registry.get(move.target)
        if target is None or state.model is None or not state.sequence:
            return
        rt.metrics.migrations.inc()
        rt.events.emit("migration", f"{state.id}: {state.backend_id} -> {target.id}",
                       trajectory=state.id, source=state.backend_id, target=target.id)
        served = rt.adapters.base_of(state.model) or state.model  # a restored family's
        task = asyncio.create_task(prewarm(rt.session, target, served,
                                           state.sequence.tolist()))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def relayout(change: Relayout) -> None:
        apply_relayout(rt, change)

    def fault(stage: str) -> None:
        rt.metrics.scheduler_faults.labels(stage).inc()
        if stage == "stall":
            rt.events.emit("stall", f"scheduler stalled: {scheduler.queue_depth} calls queued "
                           "beside free slots", queued=scheduler.queue_depth)

    scheduler.kv_usage = kv
    scheduler.on_fault = fault
    scheduler.on_migrate = migrate
    scheduler.on_relayout = relayout


def open_route_files(settings: Settings) -> RouteFiles | None:
    """The segment files routed experts go to (``traces.routes_store``); nothing is
    created on disk until a call brings routes."""
    traces = settings.traces
    if traces.routes_store != "files":
        return None
    # a segment spans a quarter of the retention at most: it is deleted soon after
    age = min(SEGMENT_AGE_S, traces.routes_retention_s / 4) if traces.routes_retention_s \
        else SEGMENT_AGE_S
    return RouteFiles(traces.routes_dir or default_routes_dir(settings.database_url),
                      segment_age_s=age)


async def _open_spools(settings: Settings) -> tuple[Spool | None, list[Spool]]:
    """This process's spool and the orphans it adopts (:func:`open_spools`). A disk that
    cannot hold one (read-only, say) leaves the writer without: it then holds what the
    database cannot take in memory, and says so. Another process owning the configured
    spool stops the start (:class:`SpoolBusy`)."""
    try:
        return await asyncio.to_thread(open_spools, settings.database_url,
                                       settings.traces.spool_path,
                                       settings.traces.spool_max_bytes)
    except OSError as exc:
        log.error("no trace spool (%s): records the database cannot take wait in memory "
                  "(TRACES__QUEUE_SIZE + TRACES__OVERFLOW_SIZE)", exc)
        return None, []


@contextlib.asynccontextmanager
async def open_runtime(settings: Settings, adopt: Adopt | None = None
                       ) -> AsyncIterator[Runtime]:
    """Open every resource the gateway needs; close them in reverse on exit. ``adopt``
    sees each backend the health checker (re)admits before it is admitted
    (``gateway.weights.adopt``: what engines that outlived a gateway hold)."""
    async with contextlib.AsyncExitStack() as stack:
        if settings.auto_migrate or is_sqlite(settings.database_url):
            await asyncio.to_thread(upgrade, settings.database_url)
        engine = make_engine(settings.database_url)
        stack.push_async_callback(engine.dispose)
        route_files = open_route_files(settings)
        sessionmaker = make_sessionmaker(engine, route_files)
        session = make_session(settings.upstream)
        stack.push_async_callback(session.close)
        registry = BackendRegistry()
        for i, spec in enumerate(settings.backends):
            registry.add(parse_backend_spec(spec, i))
        health = HealthChecker(registry, settings.upstream)
        stack.push_async_callback(health.close)
        spool, orphans = await _open_spools(settings)
        writer = TraceWriter(sessionmaker, settings.traces, spool, orphans=orphans,
                             route_files=route_files)
        writer.start()
        stack.push_async_callback(writer.close)
        tracker = Tracker()
        scheduler = Scheduler(registry, tracker, get_policy(settings.policy),
                              speeds_for(settings.dispatch.speed_profile), settings.dispatch)
        rt = Runtime(
            settings=settings, engine=engine, sessionmaker=sessionmaker, session=session,
            registry=registry, health=health,
            dispatcher=Dispatcher(registry, scheduler, settings=settings.dispatch),
            tracker=tracker, writer=writer, metrics=GatewayMetrics(),
            weight_version=settings.weight_version,
            restorer=Restorer(tracker, sessionmaker, settings=settings.restore,
                              written=lambda tid, t: writer.stored(tid, timeout_s=t)),
        )
        for model, base in settings.lora_models.items():
            rt.adapters.declare(model, base)
        if adopt is not None:
            health.on_fresh = functools.partial(adopt, rt)
        await health.check_all()
        health.start()
        rt.metrics.add_collector(rt.collect)
        rt.mismatch = MismatchBoard(mismatch_limits(settings), rt.events)
        rt.metrics.add_collector(rt.mismatch.collect)
        stack.push_async_callback(rt.restorer.close)
        expiry = Expiry(tracker, settings.trajectories)
        expiry.start()
        stack.push_async_callback(expiry.close)
        if settings.traces.routes_retention_s is not None and not settings.shard_index:
            rt.routes_retention = RoutesRetention(sessionmaker,
                                                  settings.traces.routes_retention_s,
                                                  files=route_files)
            rt.routes_retention.start()
            stack.push_async_callback(rt.routes_retention.close)
        wire_scheduler(rt, scheduler)
        scheduler.start()
        stack.push_async_callback(scheduler.close)
        rt.monitor.start(rt)
        stack.push_async_callback(rt.monitor.close)
        stack.push_async_callback(rt.jobs.close)
        if settings.pool is not None:
            rt.pool = await stack.enter_async_context(
                open_pool(rt, settings.pool, rt.dispatcher))
        yield rt
        rt.ready = False
