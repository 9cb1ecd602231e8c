"""Moving an engine from one shard to another: the front's ``move`` job.

Trajectories never move (their prefix cache lives on their engine): the engine leaves
its shard by that shard's own drain, so its calls in flight finish there, and the
trajectories that used it send their next calls to their shard's other engines.

* **An external backend** (``source: static``) is drained and unregistered on its shard
  (``DELETE /admin/backends/{id}``), then registered on the other
  (``POST /admin/backends``).
* **An instance of the managed pool** hands its GPUs over
  (:mod:`gateway.dispatch.handover`): its shard drains and stops it and takes the GPUs
  out of its inventory (``POST /admin/pool/release``), then the other shard adds them to
  its own and starts an instance of the same TP on them (``POST /admin/pool/adopt``). If
  the other shard refuses them, they go back to the shard they came from, so no GPU is
  left in neither pool.

Both are jobs of the front (``GET /admin/jobs/f4``) with a phase per step; the
rebalancer (:mod:`gateway.shards.rebalance`) starts the same jobs on its own.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from gateway.shards.shardset import POLL_S, Front, FrontJob

JOB_TIMEOUT_S = 900.0


class MoveRefused(Exception):
    """A move that cannot start; ``status`` and ``detail`` are the answer to give."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


async def start_move(front: Front, shard: int, backend: str, to: Any,
                     headers: dict[str, str]) -> Response:
    """``POST /admin/backends/s{shard}/{backend}/move {"to": n}``: 202 with the job."""
    try:
        job = await begin_move(front, shard, backend, to, headers, reason="requested")
    except MoveRefused as exc:
        body = exc.detail if isinstance(exc.detail, dict) else {"detail": exc.detail}
        return JSONResponse(body, status_code=exc.status)
    return JSONResponse({"job": job.id, "status": "running", "url": f"/admin/jobs/{job.id}"},
                        status_code=202)


async def begin_move(front: Front, shard: int, backend: str, to: Any,
                     headers: dict[str, str], reason: str) -> FrontJob:
    """Check the move and start its job; MoveRefused saying why it cannot run."""
    if not isinstance(to, int) or not 0 <= to < len(front.shards) or to == shard:
        raise MoveRefused(422, f"'to' must be another shard, 0-{len(front.shards) - 1}")
    if any(j.own is not None and j.own["status"] == "running" for j in front.jobs.values()):
        raise MoveRefused(409, "another move is running: one at a time (GET /admin/jobs)")
    listed = await front.one(shard, "GET", "/admin/backends", headers=headers)
    if not listed.ok:
        raise MoveRefused(listed.status, listed.body)
    row = next((b for b in listed.body.get("data", []) if b["id"] == backend), None)
    if row is None:
        raise MoveRefused(404, f"shard {shard} has no backend {backend!r}")
    managed = row.get("source") != "static"
    job = FrontJob(f"f{next(front._ids)}", "move", [])
    job.own = {"id": job.id, "kind": "move", "status": "running", "request": {
        "backend": f"s{shard}/{backend}", "to": to, "tp": row.get("tp") or 1,
        "gpus": row.get("gpus") or [], "managed": managed, "reason": reason},
        "created": job.created, "started": job.created, "finished": None,
        "duration_s": None, "plan": {}, "phases": [], "errors": []}
    front.jobs[job.id] = job
    work = _move_instance if managed else _move_backend
    front.tasks.add(task := asyncio.create_task(_run(job, work(front, job, shard, row, to,
                                                                headers))))
    task.add_done_callback(front.tasks.discard)
    return job


async def _run(job: FrontJob, work: Any) -> None:
    view = job.own
    assert view is not None
    t0 = time.time()
    try:
        await work
    except Exception as exc:  # a bug must not leave the job "running" forever
        view["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        view["finished"] = time.time()
        view["duration_s"] = round(view["finished"] - t0, 3)
        view["status"] = "failed" if view["errors"] else "succeeded"


async def wait_shard_job(front: Front, shard: int, job_id: str, headers: dict[str, str],
                         timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = await front.one(shard, "GET", f"/admin/jobs/{job_id}", headers=headers)
        if a.ok and a.body.get("status") not in ("pending", "running"):
            return dict(a.body)
        await asyncio.sleep(POLL_S)
    return {"status": "failed", "errors": [f"shard {shard}'s job {job_id} took too long"]}


async def _step(front: Front, view: dict[str, Any], name: str, shard: int, path: str,
                body: dict[str, Any] | None, headers: dict[str, str],
                method: str = "POST") -> dict[str, Any]:
    """One shard's job, run to its end and recorded as a phase; its final view."""
    t0 = time.time()
    hdrs = {**headers, "content-type": "application/json"}
    answer = await front.one(shard, method, path, headers=hdrs,
                             body=None if body is None else orjson.dumps(body))
    if not answer.ok:
        done = {"status": "refused", "errors": [f"shard {shard}: {answer.status} "
                                                f"{answer.body}"]}
    else:
        done = await wait_shard_job(front, shard, str(answer.body.get("job")), headers)
    view["phases"].append({"name": name, "shard": shard, "status": done["status"],
                           "job": answer.body.get("job") if answer.ok else None,
                           "duration_s": round(time.time() - t0, 3)})
    return done


async def _move_backend(front: Front, job: FrontJob, shard: int, row: dict[str, Any],
                        to: int, headers: dict[str, str]) -> None:
    view = job.own
    assert view is not None
    done = await _step(front, view, "drain", shard, f"/admin/backends/{row['id']}", None,
                       headers, method="DELETE")
    if done["status"] != "succeeded":
        view["errors"] += done.get("errors") or [f"the drain {done['status']}"]
        return
    added = await front.one(to, "POST", "/admin/backends", headers={
        **headers, "content-type": "application/json"}, body=orjson.dumps(
            {"url": row["url"], "tp": row.get("tp") or 1}))
    view["phases"].append({"name": "register", "shard": to, "status": added.status,
                           "backend": added.body})
    if not added.ok:
        view["errors"].append(f"shard {to} refused it: {added.body}")


async def _move_instance(front: Front, job: FrontJob, shard: int, row: dict[str, Any],
                         to: int, headers: dict[str, str]) -> None:
    view = job.own
    assert view is not None
    done = await _step(front, view, "release", shard, "/admin/pool/release",
                       {"id": row["id"]}, headers)
    gpus = (done.get("request") or {}).get("gpus") or row.get("gpus")
    if done["status"] == "refused":
        view["errors"] += done["errors"]
        return
    if done["status"] != "succeeded":
        view["errors"] += [*(done.get("errors") or []),
                           f"GPUs {gpus} are in neither shard's inventory until they are "
                           f"free: then POST /admin/pool/adopt on a shard"]
        return
    tp = (done.get("request") or {}).get("tp") or row.get("tp") or 1
    taken = await _step(front, view, "adopt", to, "/admin/pool/adopt",
                        {"gpus": gpus, "tp": tp}, headers)
    view["request"]["gpus"] = gpus
    if taken["status"] == "succeeded":
        return
    view["errors"] += [f"shard {to}: {e}" for e in taken.get("errors") or []]
    if taken["status"] == "refused":  # the GPUs go back where they came from
        back = await _step(front, view, "give-back", shard, "/admin/pool/adopt",
                           {"gpus": gpus, "tp": tp}, headers)
        if back["status"] != "succeeded":
            view["errors"] += [f"shard {shard}: {e}" for e in back.get("errors") or []]
