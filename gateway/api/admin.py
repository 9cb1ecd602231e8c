"""Admin API (bearer admin token): backends, the managed pool, jobs, pause, weight version.

Changes that take time (resizing the pool, removing a backend that still serves calls)
answer ``202`` with a job at once; ``GET /admin/jobs/{id}`` shows its phases. Removal
always drains first: no new calls, in-flight calls finish, then the backend goes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, Field, ValidationError, field_validator

from gateway.api.deps import get_rt, require_admin
from gateway.dispatch.backends import parse_backend_spec
from gateway.errors import BadRequest, Conflict, NotFound
from gateway.pool import handover
from gateway.pool.drain import start_remove_job, wait_idle
from gateway.pool.jobs import Job
from gateway.pool.layout import InstanceRequest, LayoutError, slot_json
from gateway.pool.manager import PoolManager
from gateway.pool.spec import LayoutEntry
from gateway.runtime import Runtime
from gateway.schema.jobs import JobList, JobRef, JobView, PoolChangeRef
from gateway.schema.weights import WeightVersionChange
from gateway.weights import lora
from gateway.weights.job import checkpoint_problems, no_engine, start_weight_update_job
from gateway.weights.update import pause_engines, relabel, resume_engines, update_engines

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])
REMOVE_DRAIN_TIMEOUT_S = 600.0
MAX_GPUS = 65_536  # bounds what a request can make the layout code allocate
MAX_INSTANCES = 4096


class AddBackend(BaseModel):
    """An external URL, or (without ``url``) a new instance of the managed pool."""

    url: str | None = Field(None, min_length=8, max_length=512)
    tp: int | None = Field(None, ge=1, le=64)
    id: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    gpus: list[Annotated[int, Field(ge=0, lt=MAX_GPUS)]] | None = Field(None, max_length=64)
    node: str | None = Field(None, max_length=128)


class PoolChange(BaseModel):
    """``gpus``: a count, or GPU ids (``3`` or ``"node:3"``) of the inventory to keep;
    ``layout``: the instances wanted; ``tp``: TP of instances created on freed GPUs."""

    gpus: int | list[int | str] | None = None
    layout: list[LayoutEntry] | None = Field(None, max_length=MAX_INSTANCES)
    tp: int | None = Field(None, ge=1, le=64)

    @field_validator("gpus")
    @classmethod
    def _gpus_in_range(cls, value: int | list[int | str] | None) -> int | list[int | str] | None:
        count = value if isinstance(value, int) else len(value or ())
        if not 0 <= count <= MAX_GPUS:
            raise ValueError(f"'gpus' must be between 0 and {MAX_GPUS}")
        if isinstance(value, list) and any(isinstance(g, int) and not 0 <= g < MAX_GPUS
                                           for g in value):
            raise ValueError(f"GPU ids are between 0 and {MAX_GPUS - 1}")
        return value

    @field_validator("layout")
    @classmethod
    def _instances_in_range(cls, value: list[LayoutEntry] | None) -> list[LayoutEntry] | None:
        if value is not None and sum(e.count for e in value) > MAX_INSTANCES:
            raise ValueError(f"a layout has at most {MAX_INSTANCES} instances")
        return value


class Release(BaseModel):
    id: str = Field(max_length=64, description="the instance whose GPUs leave this pool")


class Adopt(BaseModel):
    gpus: list[Annotated[int, Field(ge=0, lt=MAX_GPUS)] | Annotated[str, Field(
        max_length=160)]] = Field(min_length=1, max_length=64, description="GPUs (3 or "
        "'node:3') joining this pool's inventory, one instance's worth")
    tp: int | None = Field(None, ge=1, le=64, description="default: one per GPU given")
    id: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")


class Pause(BaseModel):
    mode: Literal["wait", "reject", "keep", "abort-and-continue"] | None = Field(
        None, description="wait/reject: hold new calls, or answer 429 (default: the "
        "settings' mode); keep/abort-and-continue: hold new calls and pause the engines "
        "that way (see docs/weight-updates.md)")
    engine_mode: Literal["wait", "keep", "abort-and-continue"] | None = Field(
        None, description="also pause the engines (vLLM /pause); implied by mode "
        "keep/abort-and-continue")
    wait_idle: bool = Field(False, description="answer once no call is in flight")
    timeout_s: float = Field(60.0, ge=0, le=3600)


class Resume(BaseModel):
    weight_version: str | None = Field(None, min_length=1, max_length=128)
    timeout_s: float = Field(60.0, ge=0, le=3600)


class WeightUpdate(BaseModel):
    version: str = Field(min_length=1, max_length=128)
    mode: Literal["wait", "keep", "abort-and-continue"] = "abort-and-continue"
    method: Literal["reload", "external", "lora"] = Field(
        "external", description="reload: engines reload weights (weights_path); external: "
        "the trainer pushes them and calls POST /admin/weight-update/{job}/done; lora: "
        "engines load the LoRA adapter at lora_path beside the ones they run, and calls "
        "on base_model run on it from now on, no engine paused (docs/weight-updates.md)")
    weights_path: str | None = Field(None, max_length=1024)
    lora_path: str | None = Field(None, max_length=1024, description="method lora: the "
                                  "adapter's directory (adapter_config.json, weights)")
    base_model: str | None = Field(None, max_length=256, description="method lora: the "
                                   "served model the adapter applies to (default: the one "
                                   "model served)")
    model: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[^@\s]+$",
                              description="method lora: the model name calls for this "
                              "adapter's family ask for: a LoRA family of base_model "
                              "(created by its first adapter, or declared by "
                              "ROLLOUT_GATEWAY_LORA_MODELS), with its own weight version; "
                              "default: base_model's own family")
    keep: int | None = Field(None, ge=1, le=64, description="method lora: adapters of the "
                             "family kept loaded, this one included (default: its "
                             "staleness bound + 1, or 2 without a bound)")
    timeout_s: float = Field(300.0, gt=0, le=3600)


class WeightVersion(BaseModel):
    version: str = Field(min_length=1, max_length=128)


def _job_ref(job: Job) -> JobRef:
    return JobRef(job=job.id, status=job.status, url=f"/admin/jobs/{job.id}")


def _job_json(job: Job) -> dict[str, Any]:
    """:func:`_job_ref` inside the answers that are still untyped (backends)."""
    return _job_ref(job).model_dump(mode="json")


def _pool(rt: Runtime) -> PoolManager:
    if rt.pool is None:
        raise Conflict("no managed pool: start the gateway with --pool FILE")
    return rt.pool


@router.get("/backends")
async def list_backends(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    return {"data": [{"id": b.id, "url": b.url, "tp": b.tp or 1, "gpus": list(b.gpus),
                      "healthy": b.healthy, "state": b.state.value, "in_flight": b.in_flight,
                      "source": b.source} for b in rt.registry]}


@router.post("/backends", status_code=201)
async def add_backend(body: AddBackend, response: Response,
                      rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """201 with an external backend registered, or 202 with the job starting an instance."""
    if body.url is None:
        response.status_code = 202
        request = InstanceRequest(tp=body.tp or 1, node=body.node, id=body.id,
                                  gpus=None if body.gpus is None else tuple(body.gpus))
        try:
            return _job_json(_pool(rt).add_instance(request))
        except LayoutError as exc:
            raise BadRequest(str(exc)) from None
    try:
        backend = parse_backend_spec(body.url, len(rt.registry))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    backend.id = body.id or f"b{len(rt.registry)}"
    backend.tp = body.tp or backend.tp
    while rt.registry.get(backend.id) is not None:
        backend.id += "x"
    rt.registry.add(backend)
    await rt.health.check(backend)
    return {"id": backend.id, "url": backend.url, "healthy": backend.healthy}


@router.delete("/backends/{backend_id}", status_code=202)
async def remove_backend(backend_id: str, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """Drain, then remove (a pool instance is also stopped); returns the job."""
    job = rt.pool.remove_instance(backend_id) if rt.pool is not None else None
    if job is None:
        backend = rt.registry.get(backend_id)
        if backend is None:
            raise NotFound(f"no backend {backend_id!r}")
        job = start_remove_job(rt.registry, rt.jobs, backend, REMOVE_DRAIN_TIMEOUT_S)
    return {"id": backend_id, "draining": True, **_job_json(job)}


@router.get("/pool")
async def get_pool(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    gate = rt.dispatcher.gate
    paused = {"paused": gate.paused, "paused_since": gate.paused_at}
    if rt.pool is None:
        return {"managed": False, **paused, "instances": (await list_backends(rt))["data"]}
    return {"managed": True, **paused, **rt.pool.to_dict(),
            "jobs": [_job_ref(j) for j in rt.jobs.recent(10)]}


@router.put("/pool", status_code=202, response_model=None)
async def change_pool(body: PoolChange, response: Response, dry_run: bool = False,
                      rt: Runtime = Depends(get_rt)) -> PoolChangeRef | dict[str, Any]:
    """Resize and/or re-lay-out the pool; validated now, applied by the returned job.
    ``?dry_run=true``: 200 with what it would apply, nothing changed (the sharded front
    checks every shard this way before it changes any)."""
    if body.gpus is None and body.layout is None and body.tp is None:
        raise BadRequest("give 'gpus', 'layout' or 'tp'")
    pool = _pool(rt)
    try:
        layout = (None if body.layout is None
                  else [r for e in body.layout for r in e.requests()])
        if dry_run:
            active, target = pool.plan_change(gpus=body.gpus, layout=layout, tp=body.tp)
            response.status_code = 200
            return {"dry_run": True, "planned": [s.id for s in target],
                    "active_gpus": [slot_json(g) for g in active]}
        job = pool.reconfigure(gpus=body.gpus, layout=layout, tp=body.tp)
    except (LayoutError, ValidationError, ValueError) as exc:
        raise BadRequest(str(exc)) from None
    return PoolChangeRef(**_job_ref(job).model_dump(), planned=[s.id for s in pool.planned])


@router.post("/pool/release", status_code=202)
async def release_gpus(body: Release, rt: Runtime = Depends(get_rt)) -> JobRef:
    """Drain and stop one instance and give its GPUs up (a shard handing them to another:
    docs/scaling.md); the job's request names the GPUs."""
    try:
        return _job_ref(handover.release(_pool(rt), body.id))
    except handover.NoSuchInstance as exc:
        raise NotFound(str(exc)) from None
    except handover.HandoverConflict as exc:
        raise Conflict(str(exc)) from None
    except LayoutError as exc:
        raise BadRequest(str(exc)) from None


@router.post("/pool/adopt", status_code=202)
async def adopt_gpus(body: Adopt, rt: Runtime = Depends(get_rt)) -> JobRef:
    """Take GPUs another pool released into the inventory and start an instance on them."""
    try:
        return _job_ref(handover.adopt(_pool(rt), body.gpus, body.tp, body.id))
    except handover.HandoverConflict as exc:
        raise Conflict(str(exc)) from None
    except LayoutError as exc:
        raise BadRequest(str(exc)) from None


@router.get("/jobs")
async def list_jobs(rt: Runtime = Depends(get_rt)) -> JobList:
    return JobList(data=[JobView.model_validate(j.to_dict()) for j in rt.jobs.recent(50)])


@router.get("/jobs/{job_id}")
async def get_job(job_id: str, rt: Runtime = Depends(get_rt)) -> JobView:
    job = rt.jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return JobView.model_validate(job.to_dict())


@router.post("/pause")
async def pause(body: Pause | None = None, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """Hold (or refuse) new calls for a weight sync; calls in flight finish."""
    body = body or Pause()
    gate = rt.dispatcher.gate
    engine_mode = body.engine_mode
    admission: Literal["wait", "reject"] | None
    if body.mode in ("keep", "abort-and-continue"):
        engine_mode, admission = body.mode, "wait"
    else:
        admission = "reject" if body.mode == "reject" else "wait" if body.mode else None
    engines: dict[str, Any] = {}
    if engine_mode is not None:
        engines = await pause_engines(rt, engine_mode, body.timeout_s, admission)
    else:
        gate.pause(admission)
    mode = admission or rt.settings.dispatch.pause_mode
    rt.events.emit("pause", f"paused for weight sync ({mode})", mode=mode)
    busy = await wait_idle(list(rt.registry), body.timeout_s) if body.wait_idle else None
    return {"paused": True, "since": gate.paused_at, "mode": mode,
            "in_flight": sum(b.in_flight for b in rt.registry),
            "idle": None if busy is None else not busy, **engines}


@router.post("/resume")
async def resume(body: Resume | None = None, rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """Open the gate; with ``weight_version`` set it first. Engines paused by an engine
    mode are told the version and resumed, then held calls and continuations go on."""
    body = body or Resume()
    gate = rt.dispatcher.gate
    if body.weight_version not in (None, rt.weight_version) and (
            why := lora.base_weights_locked(rt)) is not None:
        raise Conflict(why)  # nothing resumed: resume without a version, or push an adapter
    if gate.engine_mode is not None or body.weight_version is not None:
        out = await resume_engines(rt, body.weight_version, body.timeout_s)
        return {"paused": False, **out}
    was_paused = gate.paused
    held = gate.resume()
    if was_paused:
        rt.events.emit("resume", f"resumed after {held:.1f} s", paused_s=round(held, 3))
    return {"paused": False, "paused_s": round(held, 3), "weight_version": rt.weight_version}


@router.post("/flush")
async def flush(rt: Runtime = Depends(get_rt)) -> dict[str, Any]:
    """Write what the trace writer holds to the store now (a sharded gateway's front
    flushes every shard before it reads samples from the store)."""
    drained = await rt.writer.drain(30.0)
    return {"drained": drained, "written": rt.writer.written,
            "queue_depth": rt.writer.queue_depth}


@router.post("/weight-update", status_code=202, response_model=None)
async def weight_update(body: WeightUpdate, response: Response, dry_run: bool = False,
                        rt: Runtime = Depends(get_rt)) -> JobRef | dict[str, Any]:
    """Run pause -> update -> set version -> resume on every engine, as a job.
    ``?dry_run=true``: 200 with the engines it would update, or the 4xx its check would
    fail with, nothing paused (the sharded front checks every shard this way before it
    starts any)."""
    if body.method == "reload" and not body.weights_path:
        raise BadRequest("method 'reload' needs 'weights_path'", param="weights_path")
    if any(j.kind == "weight-update" and not j.done for j in rt.jobs.recent(50)):
        raise Conflict("a weight update is already running")
    if body.method == "lora":
        return await _lora_update(body, response, dry_run, rt)
    if (why := lora.base_weights_locked(rt)) is not None:
        raise Conflict(why)
    if dry_run:
        targets = update_engines(rt)
        if (why := no_engine(rt, body.method, targets)) is not None:
            raise Conflict(why)
        if problems := await checkpoint_problems(body.method, body.weights_path):
            raise BadRequest("; ".join(problems), param="weights_path")
        response.status_code = 200
        return {"dry_run": True, "engines": [b.id for b in targets]}
    job, done = start_weight_update_job(
        rt, version=body.version, engine_mode=body.mode, method=body.method,
        weights_path=body.weights_path, timeout_s=body.timeout_s)
    rt.trainer_pushes[job.id] = done
    return _job_ref(job)


async def _lora_update(body: WeightUpdate, response: Response, dry_run: bool,
                       rt: Runtime) -> JobRef | dict[str, Any]:
    """``method: "lora"`` (:mod:`gateway.weights.lora`): its check answers 400/409 before
    any job starts, dry run or not."""
    adapter, keep, targets = await lora.checked_update(
        rt, body.version, body.lora_path, base_model=body.base_model, keep=body.keep,
        model=body.model)
    if dry_run:
        response.status_code = 200
        return {"dry_run": True, "engines": [b.id for b in targets],
                "adapter": adapter.to_dict(), "keep": keep}
    return _job_ref(lora.start_lora_update_job(rt, adapter, keep=keep,
                                               timeout_s=body.timeout_s))


@router.post("/weight-update/{job_id}/done")
async def weight_update_done(job_id: str, rt: Runtime = Depends(get_rt)) -> JobRef:
    """The trainer has pushed the new weights into the engines (method ``external``)."""
    job = rt.jobs.get(job_id)
    event = rt.trainer_pushes.get(job_id)
    if job is None or event is None:
        raise NotFound(f"no weight-update job {job_id!r}")
    if job.done:
        raise Conflict(f"job {job_id} already ended ({job.status.value})")
    event.set()
    return _job_ref(job)


@router.put("/weight-version")
async def set_weight_version(body: WeightVersion,
                             rt: Runtime = Depends(get_rt)) -> WeightVersionChange:
    """Stamped on every call dispatched from now on (calls already running keep theirs);
    the engines are told, so that their own labels say it too."""
    if body.version != rt.weight_version and (why := lora.base_weights_locked(rt)):
        raise Conflict(why)
    return WeightVersionChange.model_validate(await relabel(rt, body.version))
