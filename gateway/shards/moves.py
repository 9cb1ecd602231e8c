"""Moving an engine from one shard to another: the front's ``move`` job.

Trajectories never move (their prefix cache lives on their engine): the engine leaves
its shard by that shard's own drain, so its calls in flight finish there, and the
trajectories that used it send their next calls to their shard's other engines.

* **An external backend** (``source: static``) is drained and unregistered on its shard
  (``DELETE /admin/backends/{id}``), then registered on the other
  (``POST /admin/backends``).
* **An instance of the managed pool** hands its GPUs over
  (:mod:`gateway.pool.handover`): its shard drains and stops it and takes the GPUs
  out of its inventory (``POST /admin/pool/release``), then the other shard adds them to
  its own and starts an instance of the same TP on them (``POST /admin/pool/adopt``). If
  the other shard refuses them (a 4xx), they go back to the shard they came from; if it
  cannot be reached, its inventory says whether it took them before anything is given
  back, so a GPU is never in two pools. Whether the GPUs are free is read off the giving
  shard's pool (the instance gone, the GPUs out of its inventory), not off its job's
  status: a drain that timed out still stopped the instance.

One move at a time (checked before anything is awaited), never the last engine of a
shard, and a front resize waits for the move. Both kinds are jobs of the front (``GET
/admin/jobs/f4``) with a phase per step; the rebalancer (:mod:`gateway.shards.rebalance`)
starts the same jobs on its own. After a managed move the launcher of ``serve --shards``
rewrites both shards' pool specs (``Front.persist``), so a shard restarted by hand starts
on the GPUs it holds now.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from gateway.pool.layout import slot_json
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
    if front.moving is not None:  # claimed before the first await: one move at a time
        raise MoveRefused(409, f"move {front.moving} is running: one at a time "
                          f"(GET /admin/jobs/{front.moving})")
    job = FrontJob(f"f{next(front._ids)}", "move", [])
    front.moving = job.id
    try:
        row = await _movable(front, shard, backend, headers)
    except BaseException:
        front.moving = None
        raise
    managed = row.get("source") != "static"
    job.own = {"id": job.id, "kind": "move", "status": "running", "request": {
        "backend": f"s{shard}/{backend}", "to": to, "tp": row.get("tp") or 1,
        "gpus": row.get("gpus") or [], "managed": managed, "reason": reason},
        "created": job.created, "started": job.created, "finished": None,
        "duration_s": None, "plan": {}, "phases": [], "errors": []}
    front.jobs[job.id] = job
    work = _move_instance if managed else _move_backend
    front.tasks.add(task := asyncio.create_task(_run(front, job, work(
        front, job, shard, row, to, headers))))
    task.add_done_callback(front.tasks.discard)
    return job


async def _movable(front: Front, shard: int, backend: str,
                   headers: dict[str, str]) -> dict[str, Any]:
    """The backend's row on its shard; MoveRefused if there is none or it is the shard's
    last routable engine."""
    listed = await front.one(shard, "GET", "/admin/backends", headers=headers)
    if not listed.ok:
        raise MoveRefused(listed.status, listed.body)
    rows = listed.body.get("data", [])
    row = next((b for b in rows if b["id"] == backend), None)
    if row is None:
        raise MoveRefused(404, f"shard {shard} has no backend {backend!r}")
    others = [b for b in rows if b["id"] != backend and b.get("healthy")
              and b.get("state") == "ready"]
    if not others:
        raise MoveRefused(409, f"s{shard}/{backend} is shard {shard}'s last serving engine: "
                          "its trajectories would have none")
    return dict(row)


async def _run(front: Front, job: FrontJob, work: Any) -> None:
    view = job.own
    assert view is not None
    t0 = time.time()
    status = None
    try:
        await work
    except asyncio.CancelledError:
        status = "cancelled"
        view["errors"].append("cancelled (the front stopped): see each shard's pool")
        raise
    except Exception as exc:  # a bug must not leave the job "running" forever
        view["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        front.moving = None
        view["finished"] = time.time()
        view["duration_s"] = round(view["finished"] - t0, 3)
        view["status"] = status or ("failed" if view["errors"] else "succeeded")


async def wait_shard_job(front: Front, shard: int, job_id: str, headers: dict[str, str],
                         timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = await front.one(shard, "GET", f"/admin/jobs/{job_id}", headers=headers)
        if a.ok and a.body.get("status") not in ("pending", "running"):
            return dict(a.body)
        await asyncio.sleep(POLL_S)
    return {"status": "timeout", "errors": [f"shard {shard}'s job {job_id} was still running "
                                            f"after {timeout_s:g} s"]}


async def _step(front: Front, view: dict[str, Any], name: str, shard: int, path: str,
                body: dict[str, Any] | None, headers: dict[str, str],
                method: str = "POST") -> dict[str, Any]:
    """One shard's job, run to its end and recorded as a phase; its final view. Its
    status is ``refused`` (the shard answered 4xx) or ``unreachable`` (5xx or no answer)
    when the job never started as far as the front knows."""
    t0 = time.time()
    hdrs = {**headers, "content-type": "application/json"}
    answer = await front.one(shard, method, path, headers=hdrs,
                             body=None if body is None else orjson.dumps(body))
    if not answer.ok:
        done = {"status": "refused" if 400 <= answer.status < 500 else "unreachable",
                "errors": [f"shard {shard}: {answer.status} {answer.body}"]}
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


async def _pool_of(front: Front, shard: int, headers: dict[str, str]) -> dict[str, Any] | None:
    a = await front.one(shard, "GET", "/admin/pool", headers=headers)
    return dict(a.body) if a.ok and isinstance(a.body, dict) else None


def _holds(pool: dict[str, Any] | None, gpus: list[Any]) -> bool | None:
    """Whether ``pool`` (``GET /admin/pool``) has every GPU of ``gpus`` in its inventory;
    None if it could not be read."""
    if pool is None:
        return None
    held = {slot_json((node["node"], g)) for node in pool.get("inventory", [])
            for g in node["gpus"]}
    return all(g in held for g in gpus)


async def _move_instance(front: Front, job: FrontJob, shard: int, row: dict[str, Any],
                         to: int, headers: dict[str, str]) -> None:
    view = job.own
    assert view is not None
    done = await _step(front, view, "release", shard, "/admin/pool/release",
                       {"id": row["id"]}, headers)
    gpus = (done.get("request") or {}).get("gpus") or row.get("gpus") or []
    tp = (done.get("request") or {}).get("tp") or row.get("tp") or 1
    view["request"]["gpus"] = gpus
    if done["status"] == "refused":
        view["errors"] += done["errors"]
        return
    giver = await _pool_of(front, shard, headers)
    gone = giver is not None and all(i["id"] != row["id"] for i in giver.get("instances", []))
    if done["status"] != "succeeded":  # e.g. a drain that timed out, then stopped it
        view["notes"] = [f"shard {shard}'s release: {e}" for e in done.get("errors") or []]
    if not gone or _holds(giver, gpus) is not False:
        view["errors"].append(
            f"GPUs {gpus} are not free yet (s{shard}/{row['id']} still stops): once it has, "
            f"give them to a shard with POST /admin/pool/s<n>/adopt "
            f"{{\"gpus\": {gpus}, \"tp\": {tp}}}")
        await front.persist_pools([shard], headers)
        return
    taken = await _step(front, view, "adopt", to, "/admin/pool/adopt",
                        {"gpus": gpus, "tp": tp}, headers)
    if taken["status"] == "unreachable":  # did it take them before it went quiet?
        held = _holds(await _pool_of(front, to, headers), gpus)
        taken["status"] = "refused" if held is False else "unknown"
    if taken["status"] != "succeeded":
        view["errors"] += taken.get("errors") or []
    if taken["status"] == "refused":  # the GPUs go back where they came from
        back = await _step(front, view, "give-back", shard, "/admin/pool/adopt",
                           {"gpus": gpus, "tp": tp}, headers)
        if back["status"] != "succeeded":
            view["errors"] += back.get("errors") or []
    elif taken["status"] == "unknown":
        view["errors"].append(f"shard {to} could not be read: whether it holds GPUs {gpus} "
                              "is unknown; GET /admin/pool on it says")
    await front.persist_pools([shard, to], headers)
