"""The front of a sharded gateway: one admin API, one trajectory API, one status page.

HAProxy sends model calls straight to the shards (:mod:`gateway.shards.haproxy`) and
everything else here. The front keeps no trajectory state; it asks the shards:

* **Admin writes fan out, all or nothing.** A pause, resume, weight-version, policy or
  staleness change goes to every shard at once; if one fails, the shards that applied it
  are put back as they were (a pause is resumed, a version, policy or bound set back) and
  the answer is a 502 naming each shard's outcome. Requests that start jobs (weight
  updates, pool changes) start one job per shard under one front job id
  (``GET /admin/jobs/f3``): it succeeds when every shard's job does, and a failed shard's
  job leaves that shard as the job's own rules say (its engines on the old weights), so a
  partial update shows as two versions in ``/status``.
* **Admin reads merge.** Backends are listed with their shard (``s1/b0``); ``DELETE
  /admin/backends/s1/b0`` goes to shard 1.
* **Trajectory routes go to the shard that holds the trajectory** (each shard is asked
  ``GET /trajectories/{id}/live``); one no shard holds (finished and forgotten, or never
  called) is served by the first shard from the shared store. Before anything is read
  from the store, every shard's trace writer is flushed (``POST /admin/flush``), so a
  sample is never read before its last call's record is written.
* **Status and metrics** are :mod:`gateway.shards.merge` of the shards' own.

The front authenticates nothing itself: it forwards the caller's credentials, and each
shard checks them. Its own lookups (live views, flushes) use the admin token it was
started with, the shards' own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.api.web import PAGE_HEADERS, STREAM_LIFETIME_S, asset_path
from gateway.shards.merge import merge_metrics, merge_status

FORWARDED = ("authorization", "x-api-key", "content-type")
POLL_S = 0.25


@dataclass(slots=True)
class FrontJob:
    id: str
    kind: str
    parts: list[tuple[int, str]]  # (shard, the shard's job id)
    created: float = field(default_factory=time.time)


@dataclass(slots=True)
class Answer:
    shard: int
    status: int
    body: Any

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def report(self) -> dict[str, Any]:
        return {"shard": self.shard, "status": self.status, "body": self.body}


class Front:
    """The shards and the front's own jobs."""

    def __init__(self, shards: Sequence[str], admin_token: str | None,
                 timeout_s: float = 120.0) -> None:
        self.shards = [u.rstrip("/") for u in shards]
        self.admin = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(timeout=timeout_s)
        self.jobs: dict[str, FrontJob] = {}
        self._ids = itertools.count(1)

    async def close(self) -> None:
        await self.http.aclose()

    async def one(self, shard: int, method: str, path: str, *, headers: dict[str, str],
                  params: Any = None, body: bytes | None = None) -> Answer:
        try:
            r = await self.http.request(method, self.shards[shard] + path, headers=headers,
                                        params=params, content=body)
        except httpx.HTTPError as exc:
            return Answer(shard, 503, {"detail": f"shard {shard} unreachable: {exc!r}"})
        try:
            data: Any = r.json()
        except ValueError:
            data = r.text
        return Answer(shard, r.status_code, data)

    async def every(self, method: str, path: str, *, headers: dict[str, str],
                    params: Any = None, body: bytes | None = None,
                    only: Sequence[int] | None = None) -> list[Answer]:
        which = range(len(self.shards)) if only is None else only
        return list(await asyncio.gather(*(
            self.one(i, method, path, headers=headers, params=params, body=body)
            for i in which)))

    async def owner(self, trajectory_id: str) -> int | None:
        """The shard that tracks ``trajectory_id``, if one does."""
        answers = await self.every("GET", f"/trajectories/{trajectory_id}/live",
                                   headers=self.admin)
        return next((a.shard for a in answers if a.ok), None)

    async def flush(self) -> None:
        await self.every("POST", "/admin/flush", headers=self.admin)


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}


def _json(answer: Answer, **extra: Any) -> JSONResponse:
    body = answer.body if isinstance(answer.body, dict | list) else {"detail": answer.body}
    if extra and isinstance(body, dict):
        body = {**body, **extra}
    return JSONResponse(body, status_code=answer.status)


def create_front_app(shards: Sequence[str], admin_token: str | None) -> FastAPI:
    """The front's app over ``shards`` (their base URLs, in shard order)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        front = Front(shards, admin_token)
        app.state.front = front
        try:
            yield {"front": front}
        finally:
            await front.close()

    app = FastAPI(title="rollout-gateway (sharded)", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    _status_routes(app)
    _admin_routes(app)
    _trajectory_routes(app)
    return app


def _front(request: Request) -> Front:
    front: Front = request.state.front
    return front


async def _status(front: Front) -> dict[str, Any]:
    answers = await front.every("GET", "/status", headers={})
    return merge_status([a.body if a.ok and isinstance(a.body, dict) else None
                         for a in answers], front.shards)


def _status_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        answers = await _front(request).every("GET", "/health", headers={})
        ok = all(a.ok for a in answers)
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "shards": [a.report() for a in answers]},
                            status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        answers = await _front(request).every("GET", "/ready", headers={})
        ok = all(a.ok for a in answers)
        return JSONResponse({"ready": ok, "shards": [a.report() for a in answers]},
                            status_code=200 if ok else 503)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        return await _status(_front(request))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        answers = await _front(request).every("GET", "/metrics", headers={})
        texts = [a.body if a.ok and isinstance(a.body, str) else None for a in answers]
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    @app.get("/status/stream")
    async def stream(request: Request, interval: float = 1.0) -> StreamingResponse:
        front = _front(request)

        async def events() -> AsyncIterator[bytes]:
            yield b"retry: 1000\n\n"
            deadline = time.monotonic() + STREAM_LIFETIME_S
            while time.monotonic() < deadline:
                yield b"event: status\ndata: " + orjson.dumps(await _status(front)) + b"\n\n"
                await asyncio.sleep(max(0.25, min(interval, 10.0)))

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @app.get("/")
    async def page() -> Response:
        path = asset_path("index.html")
        return Response(path.read_bytes(), media_type="text/html; charset=utf-8",
                        headers=PAGE_HEADERS)

    @app.get("/static/{name}")
    async def asset(name: str) -> Response:
        from gateway.api.web import ASSET_TYPES

        try:
            path = asset_path(name)
        except Exception:  # NotFound: the front has no error handlers of its own
            return JSONResponse({"detail": f"no asset {name!r}"}, status_code=404)
        return Response(path.read_bytes(), media_type=ASSET_TYPES[path.suffix],
                        headers=PAGE_HEADERS)


async def _before(front: Front, path: str, headers: dict[str, str]) -> list[Any]:
    """What each shard holds now that a write to ``path`` would change (to put it back)."""
    if path == "/admin/weight-version":
        return [a.body.get("weight_version") if a.ok else None
                for a in await front.every("GET", "/status", headers=headers)]
    if path in ("/admin/policy", "/admin/staleness"):
        return [a.body if a.ok else None
                for a in await front.every("GET", path, headers=headers)]
    return []


async def _put_back(front: Front, path: str, headers: dict[str, str], done: list[int],
                    before: list[Any]) -> list[int]:
    """Undo a write on the shards in ``done``; the shards it was undone on."""
    undo: list[tuple[int, str, str, bytes | None]] = []
    for i in done:
        if path == "/admin/pause":
            undo.append((i, "POST", "/admin/resume", None))
        elif path == "/admin/weight-version" and before and before[i]:
            undo.append((i, "PUT", path, orjson.dumps({"version": before[i]})))
        elif path == "/admin/policy" and before and before[i]:
            undo.append((i, "PUT", path, orjson.dumps({"policy": before[i]["policy"]})))
        elif path == "/admin/staleness" and before and before[i] is not None:
            undo.append((i, "PUT", path, orjson.dumps(before[i])))
    hdrs = {**headers, "content-type": "application/json"}
    answers = await asyncio.gather(*(front.one(i, m, p, headers=hdrs, body=b)
                                     for i, m, p, b in undo))
    return [a.shard for a in answers if a.ok]


def _job_view(front: Front, job: FrontJob, parts: list[Answer]) -> dict[str, Any]:
    """One job over the shards' jobs: failed if one failed, done when all are, and its
    phases those every shard's job has reached (a trainer pushing weights waits on the
    ``update`` phase: it must have been reached everywhere)."""
    views = [a.body if a.ok and isinstance(a.body, dict) else {} for a in parts]
    states = [v.get("status", "failed") for v in views]
    status = ("failed" if "failed" in states or "cancelled" in states
              else "succeeded" if all(s == "succeeded" for s in states)
              else "pending" if all(s == "pending" for s in states) else "running")
    names = [[p.get("name") for p in v.get("phases") or []] for v in views]
    common = [n for n in (names[0] if names else []) if all(n in ns for ns in names)]
    finished = [float(v["finished"]) for v in views if v.get("finished") is not None]
    return {"id": job.id, "kind": job.kind, "status": status, "request": {},
            "created": job.created, "started": job.created,
            "finished": max(finished) if status in ("succeeded", "failed")
            and len(finished) == len(views) else None,
            "duration_s": None, "plan": {"shards": [v.get("plan") for v in views]},
            "phases": [{"name": n} for n in common],
            "errors": [f"shard {a.shard}: {e}" for a, v in zip(parts, views, strict=True)
                       for e in v.get("errors") or ([] if a.ok else [str(a.body)])],
            "shards": [{"shard": s, "job": jid} for s, jid in job.parts]}


async def _job_parts(front: Front, job: FrontJob, headers: dict[str, str]) -> list[Answer]:
    return list(await asyncio.gather(*(front.one(s, "GET", f"/admin/jobs/{jid}",
                                                  headers=headers) for s, jid in job.parts)))


def _split_pool(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A pool change per shard: a GPU count split evenly, a layout entry by entry."""
    if isinstance(body.get("gpus"), int):
        k = body["gpus"]
        return [{**body, "gpus": k // n + (1 if i < k % n else 0)} for i in range(n)]
    if isinstance(body.get("layout"), list):
        return [{**body, "layout": body["layout"][i::n]} for i in range(n)]
    return [body] * n


def _admin_routes(app: FastAPI) -> None:
    @app.get("/admin/jobs/{job_id}")
    async def job(request: Request, job_id: str) -> Response:
        front = _front(request)
        found = front.jobs.get(job_id)
        if found is None:
            return JSONResponse({"detail": f"no job {job_id!r}"}, status_code=404)
        parts = await _job_parts(front, found, _headers(request))
        if any(a.status in (401, 403) for a in parts):
            return _json(next(a for a in parts if a.status in (401, 403)))
        return JSONResponse(_job_view(front, found, parts))

    @app.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def admin(request: Request, path: str) -> Response:
        front, headers = _front(request), _headers(request)
        full, body = f"/admin/{path}", await request.body()
        if request.method == "GET":
            return _merged_read(full, await front.every(
                "GET", full, headers=headers, params=request.query_params))
        if path.startswith("backends/s") and "/" in path[len("backends/"):]:
            shard, backend = path[len("backends/s"):].split("/", 1)
            return _json(await front.one(int(shard), request.method,
                                         f"/admin/backends/{backend}", headers=headers))
        if path.startswith("weight-update/") and path.endswith("/done"):
            found = front.jobs.get(path.split("/")[1])
            if found is None:
                return JSONResponse({"detail": "no such job"}, status_code=404)
            answers = await asyncio.gather(*(front.one(
                s, "POST", f"/admin/weight-update/{jid}/done", headers=headers)
                for s, jid in found.parts))
            return _all_or_report(list(answers), "weight push done")
        return await _fan_out_write(front, request.method, full, headers, body,
                                    request.query_params)


def _merged_read(path: str, answers: list[Answer]) -> Response:
    bad = next((a for a in answers if not a.ok), None)
    if bad is not None:
        return _json(bad, shards=[a.report() for a in answers])
    if path == "/admin/backends":
        rows = [{**b, "id": f"s{a.shard}/{b['id']}", "shard": a.shard}
                for a in answers for b in a.body.get("data", [])]
        return JSONResponse({"data": rows})
    first = answers[0].body
    merged = dict(first) if isinstance(first, dict) else {"data": first}
    return JSONResponse({**merged, "shards": [a.report() for a in answers]})


def _all_or_report(answers: list[Answer], what: str,
                   rolled_back: list[int] | None = None) -> Response:
    if all(a.ok for a in answers):
        first = answers[0].body if isinstance(answers[0].body, dict) else {}
        return JSONResponse({**first, "shards": [a.report() for a in answers]},
                            status_code=answers[0].status)
    failed = [a.shard for a in answers if not a.ok]
    statuses = {a.status for a in answers}
    if len(statuses) == 1 and 400 <= answers[0].status < 500:  # the caller's: pass it on
        return _json(answers[0], shards=[a.report() for a in answers])
    return JSONResponse({"detail": f"{what} failed on shard(s) {failed}; "
                         + (f"undone on {rolled_back}" if rolled_back is not None
                            else "the others applied it"),
                         "shards": [a.report() for a in answers],
                         "rolled_back": rolled_back}, status_code=502)


async def _fan_out_write(front: Front, method: str, path: str, headers: dict[str, str],
                         body: bytes, params: Any) -> Response:
    before = await _before(front, path, headers)
    if path == "/admin/pool" and body:
        parts = _split_pool(orjson.loads(body), len(front.shards))
        answers = list(await asyncio.gather(*(front.one(
            i, method, path, headers=headers, params=params, body=orjson.dumps(b))
            for i, b in enumerate(parts))))
    elif path == "/admin/backends":  # one new instance: on the shard with the fewest
        counts = [len(a.body.get("data", [])) if a.ok else 1 << 30
                  for a in await front.every("GET", "/admin/backends", headers=headers)]
        return _json(await front.one(counts.index(min(counts)), method, path,
                                     headers=headers, body=body))
    else:
        answers = await front.every(method, path, headers=headers, params=params, body=body)
    if all(a.ok for a in answers) and any(
            isinstance(a.body, dict) and "job" in a.body for a in answers):
        job = FrontJob(f"f{next(front._ids)}", path.rsplit("/", 1)[-1],
                       [(a.shard, str(a.body["job"])) for a in answers])
        front.jobs[job.id] = job
        return JSONResponse({"job": job.id, "status": "running",
                             "url": f"/admin/jobs/{job.id}", "planned": [],
                             "shards": [a.report() for a in answers]}, status_code=202)
    if all(a.ok for a in answers):
        return _all_or_report(answers, path)
    done = [a.shard for a in answers if a.ok]
    rolled = await _put_back(front, path, headers, done, before) if done else []
    return _all_or_report(answers, f"{method} {path}", rolled)


def _trajectory_routes(app: FastAPI) -> None:
    @app.get("/trajectories")
    async def list_all(request: Request) -> Response:
        front = _front(request)
        await front.flush()
        answers = await front.every("GET", "/trajectories", headers=_headers(request),
                                    params=request.query_params)
        if not all(a.ok for a in answers):
            return _json(next(a for a in answers if not a.ok))
        page = dict(answers[0].body)
        lives = [{r["id"]: r.get("live") for r in a.body.get("data", [])} for a in answers]
        page["data"] = [{**r, "live": next((lv[r["id"]] for lv in lives if lv.get(r["id"])),
                                           None)} for r in page.get("data", [])]
        return JSONResponse(page)

    @app.get("/groups/{group_id}/samples")
    async def group_samples(request: Request, group_id: str) -> Response:
        """The shards' long poll, with every writer flushed before each look."""
        front = _front(request)
        params = dict(request.query_params)
        wait = min(float(params.pop("timeout_s", 30.0)), 300.0)
        deadline = time.monotonic() + wait
        while True:
            await front.flush()
            answer = await front.one(0, "GET", f"/groups/{group_id}/samples",
                                     headers=_headers(request),
                                     params={**params, "timeout_s": 0})
            if answer.status != 408 or time.monotonic() >= deadline:
                if answer.status == 408 and isinstance(answer.body, dict):
                    answer.body["detail"] = str(answer.body.get("detail", "")).replace(
                        "after 0 s", f"after {wait:g} s")
                return _json(answer)
            await asyncio.sleep(POLL_S)

    @app.api_route("/trajectories/{trajectory_id}", methods=["GET"])
    async def one(request: Request, trajectory_id: str) -> Response:
        return await _on_owner(request, trajectory_id, "")

    @app.api_route("/trajectories/{trajectory_id}/{action}", methods=["GET", "POST"])
    async def act(request: Request, trajectory_id: str, action: str) -> Response:
        return await _on_owner(request, trajectory_id, f"/{action}")


async def _on_owner(request: Request, trajectory_id: str, suffix: str) -> Response:
    """Forward to the shard that holds the trajectory (after a flush when it reads the
    store); the first shard when none does."""
    front = _front(request)
    owner = await front.owner(trajectory_id)
    if request.method == "GET":
        await front.flush()
    answer = await front.one(0 if owner is None else owner, request.method,
                             f"/trajectories/{trajectory_id}{suffix}",
                             headers=_headers(request), params=request.query_params,
                             body=await request.body())
    return _json(answer)
