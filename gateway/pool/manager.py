"""The managed pool: instances on GPUs, applied layouts, crash restarts.

The pool manager owns the pool's *shape*. A new layout (explicit, or derived from a GPU
resize) is checked against the inventory when it is requested and then applied by one
background job at a time:

1. plan: diff against the current instances; unchanged placements keep serving;
2. retire the changed ones: ``DRAINING`` (no new calls), wait for in-flight calls,
   unregister, stop; meanwhile start new instances whose GPUs are already free;
3. start the rest on the GPUs just freed; each is registered (with its TP and GPUs, which
   every call records) only once it answers, after an optional one-token warm-up call.

While a job runs with nothing routable the dispatcher holds calls (``CapacitySource``); a
crashed instance is restarted with exponential backoff (:mod:`gateway.pool.restarts`).

The pool also holds the one record of the weights every engine must serve
(:mod:`gateway.pool.keeper`, kept current by the weight-update job): every instance it
starts begins on them and is admitted only once its own ``/weight_info`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from backends.base import InstanceSpec, Launcher, ServerState
from gateway.adapters import Adapters
from gateway.dispatch.backends import Backend
from gateway.pool.checkpoint import Weights
from gateway.pool.drain import drain
from gateway.pool.instance import PoolInstance, warm_up
from gateway.pool.jobs import Job, JobStatus
from gateway.pool.keeper import WeightKeeper
from gateway.pool.layout import (
    GpuSlot,
    InstanceRequest,
    LayoutError,
    Plan,
    diff,
    parse_slot,
    place,
    request_json,
    request_of,
    resize,
    select_gpus,
    slot_json,
    slots_of,
)
from gateway.pool.restarts import Restarts
from gateway.pool.spec import PoolSpec, StaticLauncherSpec, build_launcher, load_pool_spec

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendRegistry, HealthChecker
    from gateway.dispatch.dispatcher import Dispatcher
    from gateway.metrics import EventLog, GatewayMetrics
    from gateway.pool.jobs import JobBook

log = logging.getLogger(__name__)
GpuSelection = int | Sequence[int | str]


class PoolHost(Protocol):
    """What the pool uses of the process hosting it; ``gateway.runtime.Runtime`` is one.

    The pool registers the instances it starts, health-checks and warms them up over the
    shared HTTP session, runs its jobs on the job book and reports through the event log
    and metrics. It never sees the rest of the runtime.
    """

    @property
    def session(self) -> aiohttp.ClientSession: ...
    @property
    def registry(self) -> BackendRegistry: ...
    @property
    def health(self) -> HealthChecker: ...
    @property
    def jobs(self) -> JobBook: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def adapters(self) -> Adapters: ...  # the LoRA adapters engines load before admission
    #: the version calls are stamped with where an engine reports none
    weight_version: str


class PoolManager:
    """Applies layouts through a :class:`~backends.base.Launcher` (module docstring)."""

    def __init__(self, spec: PoolSpec, launcher: Launcher, rt: PoolHost) -> None:
        self.spec, self.launcher, self.rt = spec, launcher, rt
        self.static = isinstance(spec.launcher, StaticLauncherSpec)
        self.inventory: list[GpuSlot] = spec.inventory.slots()
        self.active: list[GpuSlot] = list(self.inventory)
        self.instances: dict[str, PoolInstance] = {}
        self.planned: list[InstanceSpec] = []  # the target of the last accepted job
        self.initial: Job | None = None  # the job that starts the spec's layout (readiness)
        self.job_lock = asyncio.Lock()  # one job (or restart) changes the pool at a time
        self.restarts = Restarts(self)
        self.keeper = WeightKeeper(rt, Weights(rt.weight_version, spec.weights_path()))

    @property
    def weights(self) -> Weights:
        """What every engine must serve (:class:`~gateway.pool.keeper.WeightKeeper`)."""
        return self.keeper.current

    @property
    def weights_lock(self) -> asyncio.Lock:
        """Held by a weight update from its pause to its resume: no engine joins meanwhile."""
        return self.keeper.lock

    # -- what the dispatcher asks (CapacitySource) -----------------------------------

    def expecting_capacity(self) -> bool:
        return (self.restarts.pending > 0 or self.rt.jobs.running > 0
                or any(i.state is ServerState.STARTING for i in self.instances.values()))

    def served_models(self) -> set[str]:
        return {self.spec.model}

    # -- requests (validated now, applied by a job) -----------------------------------

    def start(self) -> Job:
        """Bring up the spec's initial layout and start crash detection."""
        self.restarts.watch.start()
        self.initial = self.submit("initial", {"layout": "from spec"}, self.initial_specs())
        return self.initial

    def initial_specs(self) -> list[InstanceSpec]:
        ls = self.spec.launcher
        if isinstance(ls, StaticLauncherSpec):
            return [InstanceSpec(id=b.id or f"s{i}", model=self.spec.model, tp=b.tp,
                                 node="static") for i, b in enumerate(ls.backends)]
        requests = (self.spec.requests() if self.spec.layout is not None
                    else resize([], self.active, self.spec.default_tp))
        return place(requests, self.active, self.spec.model)

    def reconfigure(self, *, gpus: GpuSelection | None = None,
                    layout: Sequence[InstanceRequest] | None = None,
                    tp: int | None = None) -> Job:
        """Resize to ``gpus`` (a count or a list) and/or apply ``layout``; LayoutError if
        it cannot be placed. Without ``layout``, kept instances stay and freed GPUs get
        ``tp`` (default: the spec's ``default_tp``) instances."""
        active, target = self.plan_change(gpus=gpus, layout=layout, tp=tp)
        self.active = active
        request = {"gpus": gpus if isinstance(gpus, int | None) else list(gpus), "tp": tp,
                   "layout": None if layout is None else [request_json(r) for r in layout]}
        return self.submit("reconfigure", request, target)

    def plan_change(self, *, gpus: GpuSelection | None = None,
                    layout: Sequence[InstanceRequest] | None = None,
                    tp: int | None = None) -> tuple[list[GpuSlot], list[InstanceSpec]]:
        """What :meth:`reconfigure` would apply (active GPUs, instances), changing nothing."""
        if self.static:
            raise LayoutError("a static pool cannot be reconfigured (only backends removed)")
        active = self._select(gpus) if gpus is not None else self.active
        requests = layout if layout is not None else resize(
            self.planned, active, tp or self.spec.default_tp)
        return active, place(requests, active, self.spec.model, self.planned)

    def add_instance(self, request: InstanceRequest) -> Job:
        if self.static:
            raise LayoutError("a static pool cannot start instances")
        current = [request_of(s) for s in self.planned]
        target = place([*current, request], self.active, self.spec.model, self.planned)
        return self.submit("add-instance", request_json(request), target)

    def remove_instance(self, instance_id: str) -> Job | None:
        """Drain and stop one instance; None if the pool has no such instance."""
        if all(s.id != instance_id for s in self.planned):
            return None
        target = [s for s in self.planned if s.id != instance_id]
        return self.submit("remove-instance", {"id": instance_id}, target)

    def relayout(self, retire: Sequence[str], launch: Sequence[int], reason: str = "",
                 *, at_push: bool = False) -> Job:
        """A resource policy's decision (``gateway.policies.base.Relayout``): drain and
        stop ``retire``, start instances of the TP degrees ``launch`` on freed GPUs.
        Refused while another job runs (``at_push``: but the asking weight update)."""
        if self.static:
            raise LayoutError("a static pool cannot be reconfigured")
        if self.rt.jobs.running > at_push:
            raise LayoutError("a reconfiguration is already in progress")
        unknown = set(retire) - {s.id for s in self.planned}
        if unknown:
            raise LayoutError(f"no instances {sorted(unknown)} to retire")
        keep = [s for s in self.planned if s.id not in retire]
        requests = [*map(request_of, keep), *(InstanceRequest(tp=tp) for tp in launch)]
        target = place(requests, self.active, self.spec.model, keep)
        return self.submit("relayout", {"retire": list(retire), "launch": list(launch),
                                         "reason": reason}, target)

    def _select(self, gpus: GpuSelection) -> list[GpuSlot]:
        if isinstance(gpus, int):
            return select_gpus(self.inventory, self.planned, gpus)
        wanted = {parse_slot(g) for g in gpus}
        unknown = wanted - set(self.inventory)
        if unknown:
            raise LayoutError(f"GPUs not in the inventory: {sorted(unknown)}")
        return [s for s in self.inventory if s in wanted]

    def submit(self, kind: str, request: dict[str, Any], target: list[InstanceSpec]) -> Job:
        """Make ``target`` (already placed) the plan and apply it with a new job."""
        job = self.rt.jobs.create(kind, request)
        self.planned = target
        self.rt.events.emit("pool", f"job {job.id}: {kind} requested", job=job.id)
        self.rt.jobs.track(asyncio.create_task(self._run(job, target), name=f"job-{job.id}"))
        return job

    # -- applying a layout ------------------------------------------------------------

    async def _run(self, job: Job, target: list[InstanceSpec]) -> None:
        metrics = self.rt.metrics
        metrics.reconfigurations_running.inc()
        try:
            async with self.job_lock:
                job.begin()
                self.rt.events.emit("reconfiguration", f"job {job.id} ({job.kind}) started",
                                    job=job.id)
                await self._apply(job, target)
                job.end()
        except asyncio.CancelledError:
            job.end(JobStatus.CANCELLED)
            raise
        except Exception as exc:  # a bug must not leave the job "running" forever
            log.exception("pool job %s failed", job.id)
            job.errors.append(f"{type(exc).__name__}: {exc}")
            job.end()
        finally:
            metrics.reconfigurations_running.dec()
            result = {"succeeded": "ok", "failed": "failed"}.get(job.status.value, "cancelled")
            metrics.reconfigurations.labels(result).inc()
            self.rt.events.emit("reconfiguration", f"job {job.id} {job.status.value}",
                                job=job.id, result=result, duration_s=job.to_dict()["duration_s"])

    async def _apply(self, job: Job, target: list[InstanceSpec]) -> None:
        insts = list(self.instances.values())
        failed = [i.spec for i in insts if i.state is ServerState.FAILED]
        healthy = [i.spec for i in insts if i.state is not ServerState.FAILED]
        plan = diff(healthy, target)
        plan = Plan(plan.keep, (*plan.stop, *failed), plan.start)
        job.plan = plan.describe()
        for spec in plan.keep:  # a relayout at a push drained what it named to retire;
            inst = self.instances[spec.id]  # what the target keeps in place serves on
            if inst.state is ServerState.DRAINING:
                inst.set_state(ServerState.READY)
        busy = {slot for s in plan.stop for slot in slots_of(s)}
        stopping = {s.id for s in plan.stop}
        now = [s for s in plan.start if not slots_of(s) & busy and s.id not in stopping]
        later = [s for s in plan.start if s not in now]
        await asyncio.gather(self._retire(job, plan.stop), self._launch(job, now, "start"))
        await self._launch(job, later, "start" if not now else "start-after-stop")

    async def _retire(self, job: Job, specs: Sequence[InstanceSpec]) -> None:
        if not specs:
            return
        insts = [self.instances[s.id] for s in specs]
        for inst in insts:
            inst.set_state(ServerState.DRAINING)
        await drain(job, [i.backend for i in insts if i.backend is not None],
                    self.spec.drain_timeout_s)
        with job.phase("stop", instances=[s.id for s in specs]):
            await asyncio.gather(*(self.stop_instance(i, job) for i in insts))

    async def stop_instance(self, inst: PoolInstance, job: Job | None = None) -> None:
        inst.set_state(ServerState.STOPPING)
        if inst.backend is not None:
            self.rt.registry.remove(inst.backend.id)
        try:
            if inst.launched is not None:
                await self.launcher.stop(inst.launched)
        except Exception as exc:
            log.exception("stopping %s failed", inst.spec.id)
            if job is not None:
                job.errors.append(f"{inst.spec.id}: stop failed: {exc}")
        inst.set_state(ServerState.STOPPED)
        if self.instances.get(inst.spec.id) is inst:
            del self.instances[inst.spec.id]

    async def _launch(self, job: Job, specs: Sequence[InstanceSpec], name: str) -> None:
        if not specs:
            return
        with job.phase(name, instances=[s.id for s in specs]) as ph:
            started = await asyncio.gather(*(self.start_instance(s) for s in specs))
            ph.detail["start_s"] = {i.spec.id: i.start_s for i in started}
            job.errors += [f"{i.spec.id}: {i.error}" for i in started if i.error]

    async def start_instance(self, spec: InstanceSpec, restarts: int = 0) -> PoolInstance:
        """Start on the current weights, warm up, check the weights, register; on failure
        mark failed and schedule a restart."""
        inst = PoolInstance(spec, restarts=restarts)
        self.instances[spec.id] = inst
        t0 = time.monotonic()
        try:
            inst.weights = Weights("", self.weights.path)  # what the path holds, unlabelled
            launch = spec if self.static else dataclasses.replace(
                spec, weights_path=inst.weights.path)
            inst.launched = await self.launcher.start(launch)
            if self.spec.warmup and not self.static:
                await warm_up(self.rt.session, inst.launched.url, self.spec.model)
            inst.backend = Backend(id=spec.id, url=inst.launched.url, tp=spec.tp,
                                   gpus=spec.gpus, source=self.launcher.name,
                                   state=ServerState.STARTING)
            admitted = await self.keeper.admit(inst, static=self.static)
        except Exception as exc:
            inst.error = str(exc)[:2000]
            inst.set_state(ServerState.FAILED)
            self.rt.events.emit("backend", f"{spec.id} failed to start", backend=spec.id)
            self.restarts.schedule(inst)
            return inst
        inst.start_s = round(time.monotonic() - t0, 3)
        if admitted:
            await self._register(inst)
        return inst

    async def _register(self, inst: PoolInstance) -> None:
        backend = inst.backend
        assert backend is not None
        backend.state = ServerState.READY
        await self.rt.health.check(backend)  # fills its models; routable as it is added
        self.rt.registry.add(backend)
        inst.awaiting = None
        inst.set_state(ServerState.READY)

    def held(self) -> list[Backend]:
        """Started engines held out of rotation until they have the pushed weights."""
        return [i.backend for i in self.instances.values() if i.awaiting is not None
                and i.backend is not None and i.state is ServerState.STARTING]

    async def commit(self, weights: Weights, labels: dict[str, str | None]) -> None:
        """A weight update brought ``weights`` to the engines in ``labels`` (id -> what
        each reported): record them and admit held engines that have them now. Called
        while the update holds ``weights_lock``."""
        self.keeper.current = weights
        for inst in list(self.instances.values()):
            if inst.backend is None or inst.backend.id not in labels:
                continue
            inst.weights = weights
            if inst.awaiting is not None and labels[inst.backend.id] == weights.version:
                self.rt.events.emit("backend", f"{inst.spec.id} has weights "
                                    f"{weights.version!r}: admitted", backend=inst.spec.id)
                await self._register(inst)

    def fail(self, instance_id: str, reason: str) -> bool:
        """Take an instance whose weights are not the pool's out of rotation and restart
        it (on the current weights); False if the pool has no such running instance."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.state not in (ServerState.READY, ServerState.STARTING):
            return False
        inst.error = reason[:2000]
        inst.set_state(ServerState.FAILED)
        self.rt.events.emit("backend", f"{instance_id}: {reason}", backend=instance_id,
                            state="failed")
        self.restarts.schedule(inst)
        return True

    # -- views and shutdown -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        nodes: dict[str, list[int]] = {}
        for node, gpu in self.inventory:
            nodes.setdefault(node, []).append(gpu)
        return {
            "model": self.spec.model, "launcher": self.launcher.name,
            "inventory": [{"node": n, "gpus": g} for n, g in nodes.items()],
            "active_gpus": [slot_json(s) for s in self.active],
            "instances": [i.to_dict() for i in self.instances.values()],
            "planned": [s.id for s in self.planned],
            "reconfiguring": self.rt.jobs.running > 0,
            "restart": self.spec.restart.model_dump(),
            "weights": self.weights.to_dict(),
        }

    async def close(self) -> None:
        await self.restarts.watch.close()
        await self.rt.jobs.close()
        await asyncio.gather(*(self.stop_instance(i) for i in list(self.instances.values())))
        await self.launcher.close()


@contextlib.asynccontextmanager
async def open_pool(host: PoolHost, spec_path: Path,
                    dispatcher: Dispatcher) -> AsyncIterator[PoolManager]:
    """Load the pool spec at ``spec_path``, make the pool ``dispatcher``'s capacity source,
    start its initial layout in the background; detach and stop it on exit."""
    spec = await asyncio.to_thread(load_pool_spec, spec_path)
    pool = PoolManager(spec, build_launcher(spec), host)
    dispatcher.capacity = pool
    pool.start()
    try:
        yield pool
    finally:
        dispatcher.capacity = None
        await pool.close()

