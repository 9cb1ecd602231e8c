"""The front's view of its shards: one HTTP client, their answers, the front's own jobs
(shared by :mod:`gateway.shards.front` and :mod:`gateway.shards.fanout`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from starlette.responses import JSONResponse, Response

FORWARDED = ("authorization", "x-api-key", "content-type")
POLL_S = 0.25
log = logging.getLogger(__name__)
#: told each shard's pool (``GET /admin/pool``) after engines moved: ``serve --shards``
#: rewrites that shard's pool spec with it
Persist = Callable[[int, dict[str, Any]], None]


@dataclass(slots=True)
class FrontJob:
    id: str
    kind: str
    parts: list[tuple[int, str]]  # (shard, the shard's job id)
    created: float = field(default_factory=time.time)
    own: dict[str, Any] | None = None  # a job the front runs itself (a move): its view


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
                 timeout_s: float = 120.0, persist: Persist | None = None) -> None:
        self.shards = [u.rstrip("/") for u in shards]
        self.admin = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.AsyncClient(timeout=timeout_s)
        self.jobs: dict[str, FrontJob] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self.moving: str | None = None  # the move job running, if one (one at a time)
        #: held while a weight update is checked on every shard and started on all:
        #: two at once would each pass the checks and start on different shards
        self.updating = asyncio.Lock()
        self.persist = persist

    async def persist_pools(self, shards: Sequence[int], headers: dict[str, str]) -> None:
        """Hand each shard's pool as it is now to ``persist`` (a failure is logged: the
        move itself is done)."""
        if self.persist is None:
            return
        for i in shards:
            a = await self.one(i, "GET", "/admin/pool", headers=headers)
            try:
                if a.ok and isinstance(a.body, dict) and a.body.get("managed"):
                    self.persist(i, a.body)
            except Exception:
                log.exception("could not record shard %d's pool after a move", i)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
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

    async def job_parts(self, job: FrontJob, headers: dict[str, str]) -> list[Answer]:
        """Each shard's view of its part of ``job``."""
        return list(await asyncio.gather(*(self.one(s, "GET", f"/admin/jobs/{jid}",
                                                    headers=headers) for s, jid in job.parts)))

    async def flush(self) -> None:
        await self.every("POST", "/admin/flush", headers=self.admin)


async def admin_denied(front: Front, headers: dict[str, str]) -> Response | None:
    """None if a shard takes ``headers`` as the operator's; else its answer (the front
    checks no credential itself)."""
    answers = await front.every("GET", "/admin/staleness", headers=headers)
    if any(a.ok for a in answers):
        return None
    return as_response(next((a for a in answers if a.status in (401, 403)), answers[0]))


def forwarded_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}


def as_response(answer: Answer, **extra: Any) -> JSONResponse:
    body = answer.body if isinstance(answer.body, dict | list) else {"detail": answer.body}
    if extra and isinstance(body, dict):
        body = {**body, **extra}
    return JSONResponse(body, status_code=answer.status)


def front_of(request: Request) -> Front:
    front: Front = request.state.front
    return front
