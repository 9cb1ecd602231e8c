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
* **Engines move between shards** on request or, with ``shards.rebalance_s`` set, on the
  front's own judgement (:mod:`gateway.shards.moves`, :mod:`gateway.shards.rebalance`).

The front forwards the caller's credentials, and each shard checks them. Its own lookups
(live views, flushes) use the admin token it was started with, the shards' own, so on the
trajectory and group routes it first checks the caller as a shard would (the same
settings, :func:`gateway.api.deps.authorize`): a caller without the trainer's credential
gets its 401 or 403 at once, and never makes every shard flush its writer (a flush waits
for the store, up to minutes while it is down, and holds the shards' admin API meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.api.deps import Access, Role, authorize
from gateway.api.errors import error_response
from gateway.api.web import PAGE_HEADERS, STREAM_LIFETIME_S, asset_path
from gateway.config import Settings, ShardSettings
from gateway.errors import GatewayError
from gateway.serving import ENDS_AT_SHUTDOWN
from gateway.shards.fanout import admin_routes
from gateway.shards.merge import EVENTS_SHOWN, merge_metrics, merge_status
from gateway.shards.rebalance import Rebalancer, rebalance_routes
from gateway.shards.shardset import (
    POLL_S,
    Front,
    Persist,
    as_response,
    forwarded_headers,
    front_of,
)


def create_front_app(shards: Sequence[str], admin_token: str | None,
                     settings: ShardSettings | None = None,
                     persist: Persist | None = None, *,
                     credentials: Settings | None = None) -> FastAPI:
    """The front's app over ``shards`` (their base URLs, in shard order); ``settings``
    say when it moves engines between shards on its own (default: never); ``persist``
    records a shard's pool after engines moved (``serve --shards``: its spec file);
    ``credentials``: the shards' settings, whose tokens and keys the front checks callers
    against (default: the admin token alone)."""
    access = Access(credentials or Settings(admin_token=admin_token))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        front = Front(shards, admin_token, persist=persist)
        rebalancer = Rebalancer(front, settings or ShardSettings())
        app.state.front, app.state.rebalancer = front, rebalancer
        front.tasks.add(asyncio.create_task(rebalancer.run(), name="rebalancer"))
        try:
            yield {"front": front, "access": access}
        finally:
            await front.close()

    app = FastAPI(title="rollout-gateway (sharded)", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    _status_routes(app)
    rebalance_routes(app)  # before admin_routes' catch-all
    admin_routes(app)
    _trajectory_routes(app)
    return app


async def _status(front: Front, rebalancer: Rebalancer) -> dict[str, Any]:
    answers = await front.every("GET", "/status", headers={})
    merged = merge_status([a.body if a.ok and isinstance(a.body, dict) else None
                           for a in answers], front.shards)
    events = sorted([*merged.get("events", []), *rebalancer.events()],
                    key=lambda e: e.get("ts") or 0.0, reverse=True)
    return {**merged, "events": events[:EVENTS_SHOWN], "rebalance": rebalancer.to_dict()}


def _status_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        answers = await front_of(request).every("GET", "/health", headers={})
        ok = all(a.ok for a in answers)
        return JSONResponse({"status": "ok" if ok else "degraded",
                             "shards": [a.report() for a in answers]},
                            status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        answers = await front_of(request).every("GET", "/ready", headers={})
        ok = all(a.ok for a in answers)
        return JSONResponse({"ready": ok, "shards": [a.report() for a in answers]},
                            status_code=200 if ok else 503)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        return await _status(front_of(request), request.app.state.rebalancer)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        answers = await front_of(request).every("GET", "/metrics", headers={})
        texts = [a.body if a.ok and isinstance(a.body, str) else None for a in answers]
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4")

    @app.get("/status/stream")
    async def stream(request: Request, interval: float = 1.0) -> StreamingResponse:
        front, rebalancer = front_of(request), request.app.state.rebalancer
        request.scope[ENDS_AT_SHUTDOWN] = True

        async def events() -> AsyncIterator[bytes]:
            yield b"retry: 1000\n\n"
            deadline = time.monotonic() + STREAM_LIFETIME_S
            while time.monotonic() < deadline:
                body = orjson.dumps(await _status(front, rebalancer))
                yield b"event: status\ndata: " + body + b"\n\n"
                await asyncio.sleep(max(0.25, min(interval, 10.0)))

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    @app.get("/")
    async def page() -> Response:
        path = asset_path("index.html")
        return Response(path.read_bytes(), media_type="text/html; charset=utf-8",
                        headers=PAGE_HEADERS)

    @app.get("/view")
    @app.get("/view/{path:path}")
    async def viewer_page(path: str = "") -> Response:
        return Response(asset_path("viewer.html").read_bytes(),
                        media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    @app.get("/static/{name}")
    async def asset(name: str) -> Response:
        from gateway.api.web import ASSET_TYPES

        try:
            path = asset_path(name)
        except Exception:  # NotFound: the front has no error handlers of its own
            return JSONResponse({"detail": f"no asset {name!r}"}, status_code=404)
        return Response(path.read_bytes(), media_type=ASSET_TYPES[path.suffix],
                        headers=PAGE_HEADERS)


def _denied(request: Request) -> Response | None:
    """The shards' 401 or 403 for a caller without the trainer's credential, answered by
    the front before it asks the shards anything with its own token; None if allowed."""
    try:
        authorize(request, Role.TRAINER)
    except GatewayError as exc:
        return error_response(request, exc)
    return None


def _trajectory_routes(app: FastAPI) -> None:
    @app.get("/trajectories")
    async def list_all(request: Request) -> Response:
        if (denied := _denied(request)) is not None:
            return denied
        front = front_of(request)
        await front.flush()
        answers = await front.every("GET", "/trajectories", headers=forwarded_headers(request),
                                    params=request.query_params)
        if not all(a.ok for a in answers):
            return as_response(next(a for a in answers if not a.ok))
        page = dict(answers[0].body)
        lives = [{r["id"]: r.get("live") for r in a.body.get("data", [])} for a in answers]
        page["data"] = [{**r, "live": next((lv[r["id"]] for lv in lives if lv.get(r["id"])),
                                           None)} for r in page.get("data", [])]
        return JSONResponse(page)

    @app.get("/groups/{group_id}/samples")
    async def group_samples(request: Request, group_id: str) -> Response:
        """The shards' long poll, with every writer flushed before each look."""
        if (denied := _denied(request)) is not None:
            return denied
        front = front_of(request)
        params = dict(request.query_params)
        wait = min(float(params.pop("timeout_s", 30.0)), 300.0)
        deadline = time.monotonic() + wait
        while True:
            await front.flush()
            answer = await front.one(0, "GET", f"/groups/{group_id}/samples",
                                     headers=forwarded_headers(request),
                                     params={**params, "timeout_s": 0})
            if answer.status != 408 or time.monotonic() >= deadline:
                if answer.status == 408 and isinstance(answer.body, dict):
                    answer.body["detail"] = str(answer.body.get("detail", "")).replace(
                        "after 0 s", f"after {wait:g} s")
                return as_response(answer)
            await asyncio.sleep(POLL_S)

    @app.get("/groups/{group_id}/view")
    async def group_view(request: Request, group_id: str) -> Response:
        """The store's answer (shard 0), each member's live phase from the shard that
        tracks it."""
        if (denied := _denied(request)) is not None:
            return denied
        front = front_of(request)
        await front.flush()
        answers = await front.every("GET", f"/groups/{group_id}/view",
                                    headers=forwarded_headers(request),
                                    params=request.query_params)
        if not answers[0].ok:
            return as_response(answers[0])
        view = dict(answers[0].body)
        phases = [{m["id"]: m.get("phase") for m in a.body.get("members", [])}
                  for a in answers if a.ok and isinstance(a.body, dict)]
        view["members"] = [{**m, "phase": next((p[m["id"]] for p in phases if p.get(m["id"])),
                                               None)} for m in view.get("members", [])]
        return JSONResponse(view)

    @app.api_route("/trajectories/{trajectory_id}", methods=["GET"])
    async def one(request: Request, trajectory_id: str) -> Response:
        return await _on_owner(request, trajectory_id, "")

    @app.api_route("/trajectories/{trajectory_id}/{action}", methods=["GET", "POST"])
    async def act(request: Request, trajectory_id: str, action: str) -> Response:
        return await _on_owner(request, trajectory_id, f"/{action}")

    @app.api_route("/training/{path:path}", methods=["GET", "POST"])
    async def training(request: Request, path: str) -> Response:
        """The trainer's reports live on the first shard (the merged /status shows its)."""
        if (denied := _denied(request)) is not None:
            return denied
        return as_response(await front_of(request).one(
            0, request.method, f"/training/{path}", headers=forwarded_headers(request),
            params=request.query_params, body=await request.body()))


async def _on_owner(request: Request, trajectory_id: str, suffix: str) -> Response:
    """Forward to the shard that holds the trajectory (after a flush when it reads the
    store); the first shard when none does."""
    if (denied := _denied(request)) is not None:
        return denied
    front = front_of(request)
    owner = await front.owner(trajectory_id)
    if request.method == "GET":
        await front.flush()
    answer = await front.one(0 if owner is None else owner, request.method,
                             f"/trajectories/{trajectory_id}{suffix}",
                             headers=forwarded_headers(request), params=request.query_params,
                             body=await request.body())
    return as_response(answer)


