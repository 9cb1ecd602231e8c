"""The weight-update job: check -> pause -> update -> set version -> resume, as an admin
job (``POST /admin/weight-update``), on the pause and resume of
:mod:`gateway.weights.update`. Its check is also the job's dry run
(``?dry_run=true``), which the sharded front asks of every shard first."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from gateway.dispatch.backends import Backend
from gateway.dispatch.gate import EngineMode
from gateway.policies.base import Relayout
from gateway.pool import engines
from gateway.pool.checkpoint import Weights, check_checkpoint
from gateway.pool.jobs import Job, JobStatus
from gateway.runtime import Runtime
from gateway.weights.aborts import enforce_staleness
from gateway.weights.relayout import apply_at_push, propose_at_push
from gateway.weights.update import (
    EngineAnswer,
    current_weights,
    each_engine,
    pause_engines,
    resume_all,
    take_out,
    update_engines,
    weights_held,
)

UpdateMethod = Literal["reload", "external"]


def start_weight_update_job(rt: Runtime, *, version: str, engine_mode: EngineMode,
                            method: UpdateMethod, weights_path: str | None,
                            timeout_s: float) -> tuple[Job, asyncio.Event]:
    """Check -> pause -> update -> set version -> resume, in the background, as a job.

    ``method="reload"``: each engine reloads its weights from ``weights_path`` (vLLM
    ``/collective_rpc reload_weights``). ``"external"``: the trainer pushes the weights
    itself (NCCL, vLLM's weight-transfer routes) and says so by setting the returned
    event (``POST /admin/weight-update/{job}/done``). An update that does not check out
    (no such checkpoint, no engine to push to) fails before anything is paused. If a
    step fails, every engine goes on with the old weights and version (an engine that
    cannot be brought back to them is taken out of rotation) and the job fails.
    """
    job = rt.jobs.create("weight-update", {"version": version, "mode": engine_mode,
                                           "method": method, "weights_path": weights_path})
    trainer_done = asyncio.Event()

    async def run() -> None:
        job.begin()
        try:
            async with weights_held(rt):
                await _update(rt, job, version, engine_mode, method, weights_path,
                              timeout_s, trainer_done)
        finally:
            job.plan["weight_version"] = rt.weight_version
            job.end(None if not job.errors else JobStatus.FAILED)

    rt.jobs.track(asyncio.create_task(run(), name=f"weight-update-{job.id}"))
    return job, trainer_done


async def checkpoint_problems(method: UpdateMethod, weights_path: str | None) -> list[str]:
    """Why vLLM could not load the checkpoint of a ``reload`` (empty: it could)."""
    return (await asyncio.to_thread(check_checkpoint, weights_path)
            if method == "reload" and weights_path else [])


def no_engine(rt: Runtime, method: UpdateMethod, targets: list[Backend]) -> str | None:
    """Why an update has nothing to update, if it has not (a pool with no engine running
    takes reloaded weights for the engines it starts next)."""
    if targets or (rt.pool is not None and method == "reload"):
        return None
    return "no engine to update" + (": pushed weights need a running engine to receive "
                                    "them" if method == "external"
                                    else ": no pool to start one on them")


async def _check(rt: Runtime, job: Job, new: Weights, method: UpdateMethod,
                 targets: list[Backend]) -> bool:
    """The ``check`` phase: True if the update may pause engines; errors on the job."""
    with job.phase("check", weights=new.to_dict(), engines=[b.id for b in targets]) as ph:
        problems = await checkpoint_problems(method, new.path)
        if (why := no_engine(rt, method, targets)) is not None:
            problems.append(why)
        if not targets and not problems:  # a pool with no engine: they start on these
            ph.detail["note"] = "no engine is running: engines start on these weights"
            assert rt.pool is not None
            await rt.pool.commit(new, {})
            rt.weight_version = new.version
            rt.events.emit("weight_version", f"weight version -> {new.version} "
                           "(no engine running)", version=new.version)
            await enforce_staleness(rt)
            return False
        if problems:
            still = current_weights(rt).describe()
            job.errors += [*problems, f"nothing was paused; the pool keeps {still}"]
            return False
    return True


async def _update(rt: Runtime, job: Job, version: str, engine_mode: EngineMode,
                  method: UpdateMethod, weights_path: str | None, timeout_s: float,
                  trainer_done: asyncio.Event) -> None:
    old = current_weights(rt)
    new = Weights(version, weights_path if method == "reload" else old.path,
                  pushed=method == "external")
    targets = update_engines(rt)
    if not await _check(rt, job, new, method, targets):
        return
    ok = False
    change: Relayout | None = None
    try:
        with job.phase("pause", mode=engine_mode) as ph:
            paused = await pause_engines(rt, engine_mode, timeout_s, targets=targets)
            ph.detail.update(idle_s=paused["idle_s"], engines=paused["engines"])
        if not paused["ok"]:
            job.errors += [f"{e['id']}: {e['error']}" for e in paused["engines"]
                           if not e["ok"]]
        else:
            with job.phase("update", method=method) as ph:
                ok = await _push(rt, job, ph.detail, method, new, old, targets, timeout_s,
                                 trainer_done)
            if ok:  # the engines are paused on the new weights: the policy's moment
                change = propose_at_push(rt, engine_mode, method)
    finally:
        with job.phase("resume") as ph:
            resumed = await resume_all(rt, version if ok else None, timeout_s, targets,
                                    new if ok else None)
            ph.detail.update(weight_version=resumed["weight_version"],
                             engines=resumed["engines"])
            job.errors += [f"{e['id']}: {e['error']}" for e in resumed["engines"]
                           if e["error"]]
        if not ok:
            job.errors.append(f"weight update abandoned; resumed with version "
                              f"{old.version!r}")
    if change is not None:
        apply_at_push(rt, job, change)


async def _push(rt: Runtime, job: Job, detail: dict[str, Any], method: UpdateMethod,
                new: Weights, old: Weights, targets: list[Backend], timeout_s: float,
                trainer_done: asyncio.Event) -> bool:
    """The ``update`` phase: True if every engine has the new weights."""
    if method == "external":
        try:
            await asyncio.wait_for(trainer_done.wait(), timeout_s)
        except TimeoutError:
            job.errors.append(f"the trainer did not report the update done within "
                              f"{timeout_s:.0f} s")
            return False
        return True

    async def reload(b: Backend, path: str | None) -> EngineAnswer:
        t0 = time.monotonic()
        error = await engines.reload(rt.session, b.url, path, timeout_s)
        return EngineAnswer(b.id, b.url, "reload", error is None, time.monotonic() - t0,
                            error)

    answers = await each_engine(targets, lambda b: reload(b, new.path))
    detail["engines"] = [a.to_dict() for a in answers]
    failed = {a.id for a in answers if not a.ok}
    job.errors += [f"{a.id}: {a.error}" for a in answers if not a.ok]
    if not failed:
        return True
    # back to the old weights where the new ones went in; out of rotation where not
    back = [b for b in targets if b.id not in failed]
    if old.pushed or old.path is None:  # vLLM's own default is the path it last loaded
        undone = {b.id: "no path holds the old weights" for b in back}
    else:
        again = await each_engine(back, lambda b: reload(b, old.path))
        undone = {a.id: a.error or "" for a in again if not a.ok}
        detail["rolled_back"] = [a.to_dict() for a in again]
    for b in targets:
        if b.id in failed or b.id in undone:
            take_out(rt, b, f"weight update to {new.version!r} failed: "
                     f"{undone.get(b.id) or 'the reload failed'}")
    return False
