"""The front's admin API: writes fanned out to every shard, all or nothing; reads merged;
one job id over the shards' jobs; moves of a backend between shards (:mod:`gateway.shards.moves`)
(see :mod:`gateway.shards.front` for the whole picture)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.shards.moves import start_move
from gateway.shards.shardset import (
    Answer,
    Front,
    FrontJob,
    admin_denied,
    as_response,
    forwarded_headers,
    front_of,
)


async def _before(front: Front, path: str, headers: dict[str, str]) -> list[Any]:
    """What each shard holds now that a write to ``path`` would change (to put it back)."""
    if path == "/admin/weight-version":
        return [a.body.get("weight_version") if a.ok else None
                for a in await front.every("GET", "/status", headers=headers)]
    if path in ("/admin/policy", "/admin/staleness"):
        return [a.body if a.ok else None
                for a in await front.every("GET", path, headers=headers)]
    return []


def _staleness_undo(before: dict[str, Any], body: bytes) -> dict[str, Any]:
    """The ``PUT /admin/staleness`` body that puts back what ``body`` (one that a shard
    applied) changed: the gateway's bound, or one model's (null: it had none of its own)."""
    try:
        sent = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError:
        sent = {}
    model = sent.get("model") if isinstance(sent, dict) else None
    if isinstance(model, str):
        return {"model": model, "max_staleness": (before.get("models") or {}).get(model)}
    return {"max_staleness": before.get("max_staleness")}


async def _put_back(front: Front, path: str, headers: dict[str, str], done: list[int],
                    before: list[Any], body: bytes = b"") -> list[int]:
    """Undo a write (of ``body``) on the shards in ``done``; the shards it was undone on."""
    undo: list[tuple[int, str, str, bytes | None]] = []
    for i in done:
        if path == "/admin/pause":
            undo.append((i, "POST", "/admin/resume", None))
        elif path == "/admin/weight-version" and before and before[i]:
            undo.append((i, "PUT", path, orjson.dumps({"version": before[i]})))
        elif path == "/admin/policy" and before and before[i]:
            undo.append((i, "PUT", path, orjson.dumps({"policy": before[i]["policy"]})))
        elif path == "/admin/staleness" and before and before[i] is not None:
            undo.append((i, "PUT", path, orjson.dumps(_staleness_undo(before[i], body))))
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


def split_gpus(k: int, sizes: list[int]) -> list[int]:
    """``k`` GPUs over shards that hold ``sizes`` GPUs, in proportion (largest remainder;
    the shards' shares differ once engines moved). ValueError past what they hold."""
    total = sum(sizes)
    if not 0 <= k <= total:
        raise ValueError(f"'gpus' must be between 0 and {total}, the GPUs the shards hold "
                         f"({' + '.join(map(str, sizes))})")
    exact = [k * s / total if total else 0.0 for s in sizes]
    out = [int(e) for e in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (out[i] - exact[i], i))
    for i in by_remainder[:k - sum(out)]:
        out[i] += 1
    return out


def _split_pool(body: dict[str, Any], sizes: list[int] | None, n: int) -> list[dict[str, Any]]:
    """A pool change per shard: a GPU count in proportion to each shard's GPUs (evenly if
    they are not known), a layout entry by entry."""
    if isinstance(body.get("gpus"), int):
        k = body["gpus"]
        shares = (split_gpus(k, sizes) if sizes is not None
                  else [k // n + (1 if i < k % n else 0) for i in range(n)])
        return [{**body, "gpus": g} for g in shares]
    if isinstance(body.get("layout"), list):
        return [{**body, "layout": body["layout"][i::n]} for i in range(n)]
    return [body] * n


async def _pool_sizes(front: Front, headers: dict[str, str]) -> list[int] | None:
    """The GPUs each shard's managed pool holds, if every shard has one."""
    answers = await front.every("GET", "/admin/pool", headers=headers)
    if not all(a.ok and isinstance(a.body, dict) and a.body.get("managed") for a in answers):
        return None
    return [sum(len(node["gpus"]) for node in a.body["inventory"]) for a in answers]


def admin_routes(app: FastAPI) -> None:
    @app.get("/admin/jobs/{job_id}")
    async def job(request: Request, job_id: str) -> Response:
        front = front_of(request)
        found = front.jobs.get(job_id)
        if found is None:
            return JSONResponse({"detail": f"no job {job_id!r}"}, status_code=404)
        if found.own is not None:  # a move: the credentials checked by a shard first
            if (denied := await admin_denied(front, forwarded_headers(request))) is not None:
                return denied
            return JSONResponse(found.own)
        parts = await front.job_parts(found, forwarded_headers(request))
        if any(a.status in (401, 403) for a in parts):
            return as_response(next(a for a in parts if a.status in (401, 403)))
        return JSONResponse(_job_view(front, found, parts))

    @app.api_route("/admin/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def admin(request: Request, path: str) -> Response:
        front, headers = front_of(request), forwarded_headers(request)
        full, body = f"/admin/{path}", await request.body()
        if request.method == "GET":
            return _merged_read(full, await front.every(
                "GET", full, headers=headers, params=request.query_params))
        if path.startswith("backends/s") and "/" in path[len("backends/"):]:
            shard, backend = path[len("backends/s"):].split("/", 1)
            if (n := _shard_no(front, shard)) is None:
                return _no_shard(front, shard)
            if not backend.endswith("/move"):
                return as_response(await front.one(n, request.method,
                                                   f"/admin/backends/{backend}", headers=headers))
            try:
                target = orjson.loads(body or b"{}")
            except orjson.JSONDecodeError:
                return JSONResponse({"detail": "the body is not JSON"}, status_code=422)
            to = target.get("to") if isinstance(target, dict) else None
            return await start_move(front, n, backend.removesuffix("/move"), to, headers)
        if path in ("pool/adopt", "pool/release"):
            return JSONResponse({"detail": f"/admin/{path} acts on one shard's GPUs: move an "
                                 "engine with POST /admin/backends/s<n>/<id>/move, or send it "
                                 f"to one shard with /admin/pool/s<n>/{path[5:]}"},
                                status_code=409)
        if path.startswith("pool/s") and path.count("/") == 2:  # /admin/pool/s1/adopt
            shard, action = path[len("pool/s"):].split("/")
            if (n := _shard_no(front, shard)) is None:
                return _no_shard(front, shard)
            return as_response(await front.one(n, "POST", f"/admin/pool/{action}",
                                               headers=headers, body=body))
        if path == "pool" and front.moving is not None:
            return JSONResponse({"detail": f"move {front.moving} is running: resize once it "
                                 f"ended (GET /admin/jobs/{front.moving})"}, status_code=409)
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


def _shard_no(front: Front, text: str) -> int | None:
    """``text`` (what follows ``s`` in ``s<shard>/<backend>``) as a shard number, if one."""
    return int(text) if text.isdigit() and int(text) < len(front.shards) else None


def _no_shard(front: Front, text: str) -> Response:
    return JSONResponse({"detail": f"no shard {text!r}: backends are s<shard>/<id>, shards "
                         f"0-{len(front.shards) - 1}"}, status_code=404)


def _merged_read(path: str, answers: list[Answer]) -> Response:
    bad = next((a for a in answers if not a.ok), None)
    if bad is not None:
        return as_response(bad, shards=[a.report() for a in answers])
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
        return as_response(answers[0], shards=[a.report() for a in answers])
    return JSONResponse({"detail": f"{what} failed on shard(s) {failed}; "
                         + (f"undone on {rolled_back}" if rolled_back is not None
                            else "the others applied it"),
                         "shards": [a.report() for a in answers],
                         "rolled_back": rolled_back}, status_code=502)


async def _fan_out_write(front: Front, method: str, path: str, headers: dict[str, str],
                         body: bytes, params: Any) -> Response:
    before = await _before(front, path, headers)
    if path == "/admin/pool" and body:
        try:
            change = orjson.loads(body)
            if not isinstance(change, dict):
                raise ValueError("the body is not a JSON object")
            parts = _split_pool(change, await _pool_sizes(front, headers), len(front.shards))
        except ValueError as exc:  # orjson.JSONDecodeError is one
            return JSONResponse({"detail": str(exc)}, status_code=422)
        checks = list(await asyncio.gather(*(front.one(  # every shard first, then all
            i, method, path, headers=headers, params={"dry_run": "true"},
            body=orjson.dumps(b)) for i, b in enumerate(parts))))
        if not all(a.ok for a in checks):
            bad = next(a for a in checks if not a.ok)
            return as_response(bad, shards=[a.report() for a in checks], applied=False)
        answers = list(await asyncio.gather(*(front.one(
            i, method, path, headers=headers, params=params, body=orjson.dumps(b))
            for i, b in enumerate(parts))))
    elif path == "/admin/weight-update" and method == "POST":
        if front.updating.locked():
            return JSONResponse({"detail": "a weight update is being started on the shards",
                                 "applied": False}, status_code=409)
        async with front.updating:
            # every shard checks it first (checkpoint, engines, no update running): one
            # that would refuse it refuses it for all, before any shard pauses an engine
            checks = await front.every(method, path, headers=headers,
                                       params={"dry_run": "true"}, body=body)
            if not all(a.ok for a in checks):
                bad = next(a for a in checks if not a.ok)
                return as_response(bad, shards=[a.report() for a in checks], applied=False)
            answers = await front.every(method, path, headers=headers, params=params,
                                        body=body)
    elif path == "/admin/backends":  # one new instance: on the shard with the fewest
        counts = [len(a.body.get("data", [])) if a.ok else 1 << 30
                  for a in await front.every("GET", "/admin/backends", headers=headers)]
        return as_response(await front.one(counts.index(min(counts)), method, path,
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
    rolled = await _put_back(front, path, headers, done, before, body) if done else []
    return _all_or_report(answers, f"{method} {path}", rolled)
