"""The front's rebalancer: engines move to the shard whose calls wait for them.

Groups are hashed to shards, so shards get equal shares on average; a skewed batch (a
few heavy groups on one shard, or one shard's trajectories finished while another's run
on) leaves one shard's GPUs busy and another's idle. Every ``rebalance_s`` the front
reads each shard's ``/status`` and computes its *pressure*: calls running or queued per
GPU of its routable engines, smoothed over the last looks. When the busiest shard's
pressure is at least ``rebalance_ratio`` times the idlest's, it has at least
``rebalance_min_calls`` calls, and moving one of the idlest shard's engines lowers the
higher of the two pressures, the front moves that engine (:mod:`gateway.shards.moves`):
the smallest, least busy ready one, never a shard's last. Trajectories never move.

One move runs at a time; none starts while the pool is paused or a weight update or
resize the front fanned out still runs; after a move (or a refused one) the next
``rebalance_cooldown_s`` pass before the load counts again. ``GET
/admin/rebalance`` shows what it saw and did; ``PUT /admin/rebalance`` turns it on or
off and sets its thresholds at run time.

:func:`choose` is pure (loads in, a move or None out), so the rule is tested without
processes; the loop around it is :class:`Rebalancer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse, Response

from gateway.config import ShardSettings
from gateway.shards.moves import MoveRefused, begin_move
from gateway.shards.shardset import Front, admin_denied, forwarded_headers, front_of

log = logging.getLogger(__name__)
SMOOTHING = 0.5  # weight of the newest look in the pressure's moving average
KEPT_DECISIONS = 50


@dataclass(frozen=True, slots=True)
class Engine:
    id: str
    tp: int
    in_flight: int
    ready: bool


@dataclass(frozen=True, slots=True)
class ShardLoad:
    shard: int
    gpus: int  # of its routable engines (an external backend counts its TP)
    calls: float  # running or queued, smoothed
    engines: tuple[Engine, ...]

    @property
    def pressure(self) -> float:
        if self.calls <= 0:
            return 0.0
        return self.calls / self.gpus if self.gpus else math.inf


@dataclass(frozen=True, slots=True)
class Move:
    shard: int
    backend: str
    to: int
    reason: str


def choose(loads: Sequence[ShardLoad], ratio: float, min_calls: float) -> Move | None:
    """The one engine to move now, if any (module docstring)."""
    if len(loads) < 2:
        return None
    heavy = max(loads, key=lambda s: (s.pressure, -s.shard))
    light = min(loads, key=lambda s: (s.pressure, s.shard))
    if heavy is light or heavy.calls < min_calls or heavy.pressure < ratio * light.pressure:
        return None
    ready = [e for e in light.engines if e.ready]
    if len(light.engines) < 2 or not ready:
        return None  # a shard keeps one engine for the trajectories hashed to it
    pick = min(ready, key=lambda e: (e.tp, e.in_flight, e.id))
    after_heavy = heavy.calls / (heavy.gpus + pick.tp)
    left = light.gpus - pick.tp
    after_light = (light.calls / left if left > 0 else math.inf) if light.calls else 0.0
    if max(after_heavy, after_light) >= heavy.pressure:
        return None
    return Move(light.shard, pick.id, heavy.shard,
                f"shard {heavy.shard}: {heavy.pressure:.1f} calls/GPU, shard {light.shard}: "
                f"{light.pressure:.1f}; after the move {after_heavy:.1f} and {after_light:.1f}")


def smooth(prev: float | None, now: float) -> float:
    """The moving average of a shard's calls after one more look."""
    return now if prev is None else SMOOTHING * now + (1 - SMOOTHING) * prev


def load_of(shard: int, status: dict[str, Any], calls: float) -> ShardLoad:
    """A shard's load from its ``/status`` (``calls``: the smoothed running + queued)."""
    rows = [b for b in status.get("backends", []) if b.get("routable")]
    engines = tuple(Engine(str(b["id"]), int(b.get("tp") or 1), int(b.get("in_flight") or 0),
                           b.get("state") == "ready") for b in rows)
    gpus = sum(len(b.get("gpus") or ()) or int(b.get("tp") or 1) for b in rows)
    return ShardLoad(shard, gpus, calls, engines)


class RebalanceChange(BaseModel):
    enabled: bool | None = None
    interval_s: float | None = Field(None, gt=0, le=3600)
    ratio: float | None = Field(None, gt=1, le=100)
    min_calls: int | None = Field(None, ge=1, le=1_000_000)
    cooldown_s: float | None = Field(None, ge=0, le=3600)


class Rebalancer:
    """The loop: look, choose, move, cool down (module docstring)."""

    def __init__(self, front: Front, settings: ShardSettings) -> None:
        self.front = front
        self.enabled = settings.rebalance_s > 0
        self.interval_s = settings.rebalance_s or 10.0
        self.ratio = settings.rebalance_ratio
        self.min_calls = float(settings.rebalance_min_calls)
        self.cooldown_s = settings.rebalance_cooldown_s
        self.calls: list[float | None] = [None] * len(front.shards)
        self.loads: list[ShardLoad] = []
        self.last_move_end: float | None = None  # wall clock
        self.refused_at: float | None = None
        self._settled: set[str] = set()  # front jobs seen finished
        self.last_look: float | None = None
        self.decisions: deque[dict[str, Any]] = deque(maxlen=KEPT_DECISIONS)
        self._wake = asyncio.Event()

    def change(self, body: RebalanceChange) -> None:
        for key, value in body.model_dump(exclude_none=True).items():
            setattr(self, key, float(value) if key == "min_calls" else value)
        self._wake.set()

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "interval_s": self.interval_s, "ratio": self.ratio,
                "min_calls": self.min_calls, "cooldown_s": self.cooldown_s,
                "last_look": self.last_look,
                "quiet_for_s": round(self._quiet_for(), 1),
                "shards": [{"shard": s.shard, "gpus": s.gpus, "calls": round(s.calls, 2),
                            "pressure": None if math.isinf(s.pressure)
                            else round(s.pressure, 3)} for s in self.loads],
                "decisions": list(self.decisions)[::-1]}

    def events(self) -> list[dict[str, Any]]:
        """Its decisions as status-page events (the page lists them with the shards')."""
        return [{"seq": -k, "ts": d["at"], "kind": "rebalance",
                 "message": f"front: {d['backend']} to shard {d['to']}, {d['outcome']} "
                            f"({d['reason']})"} for k, d in enumerate(self.decisions)]

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()
            if not self.enabled:
                continue
            try:
                await self.look()
            except Exception:  # one bad look must not end the loop
                log.exception("rebalancer: a look failed")

    async def look(self) -> Move | None:
        """Read every shard, update the smoothed load, start a move if one pays."""
        answers = await self.front.every("GET", "/status", headers={})
        self.last_look = time.time()
        if not all(a.ok and isinstance(a.body, dict) for a in answers):
            return None  # a shard is down: its GPUs are not ours to judge
        loads = []
        for a in answers:
            pool = a.body.get("pool") or {}
            now = float(pool.get("running", 0)) + float(pool.get("queued", 0))
            self.calls[a.shard] = smooth(self.calls[a.shard], now)
            loads.append(load_of(a.shard, a.body, self.calls[a.shard] or 0.0))
        self.loads = loads
        if any(a.body.get("paused") for a in answers) or self._moving():
            return None
        if self._quiet_for() > 0 or await self._front_jobs_running():
            return None
        move = choose(loads, self.ratio, self.min_calls)
        if move is None:
            return None
        try:
            job = await begin_move(self.front, move.shard, move.backend, move.to,
                                   self.front.admin, reason=f"rebalance: {move.reason}")
        except MoveRefused as exc:  # counts as a move for the cool-down: no retry storm
            self._record(move, None, f"refused: {exc.detail}")
            self.refused_at = time.time()
            return None
        self._record(move, job.id, "started")
        log.info("rebalance: moving s%d/%s to shard %d (%s), job %s", move.shard,
                 move.backend, move.to, move.reason, job.id)
        return move

    def _moving(self) -> bool:
        """Whether a move runs; sets when the last one ended (for the cool-down)."""
        ends = [float(j.own["finished"]) for j in self.front.jobs.values()
                if j.own is not None and j.own.get("finished")]
        self.last_move_end = max(ends, default=None)
        return self.front.moving is not None

    def _quiet_for(self) -> float:
        last = max(self.last_move_end or 0.0, self.refused_at or 0.0)
        return max(0.0, last + self.cooldown_s - time.time()) if last else 0.0

    async def _front_jobs_running(self) -> bool:
        """Whether a weight update or resize the front fanned out still runs on a shard
        (no move starts meanwhile: a drain during a weight sync, or GPUs in transit
        during a resize, would spoil either)."""
        for job in list(self.front.jobs.values()):
            if job.own is not None or job.id in self._settled or job.kind not in (
                    "weight-update", "pool"):
                continue
            views = await self.front.job_parts(job, self.front.admin)
            if any(a.ok and a.body.get("status") in ("pending", "running") for a in views):
                return True
            self._settled.add(job.id)
        return False

    def _record(self, move: Move, job: str | None, outcome: str) -> None:
        self.decisions.append({"at": time.time(), "backend": f"s{move.shard}/{move.backend}",
                               "to": move.to, "reason": move.reason, "job": job,
                               "outcome": outcome})


def rebalance_routes(app: FastAPI) -> None:
    """``GET``/``PUT /admin/rebalance`` (the admin token, checked by the shards)."""

    @app.get("/admin/rebalance")
    async def get_rebalance(request: Request) -> Response:
        front = front_of(request)
        if (denied := await admin_denied(front, forwarded_headers(request))) is not None:
            return denied
        return JSONResponse(request.app.state.rebalancer.to_dict())

    @app.put("/admin/rebalance")
    async def put_rebalance(request: Request) -> Response:
        front = front_of(request)
        if (denied := await admin_denied(front, forwarded_headers(request))) is not None:
            return denied
        try:
            body = RebalanceChange.model_validate_json(await request.body() or b"{}")
        except ValidationError as exc:
            return JSONResponse({"detail": orjson.loads(exc.json())}, status_code=422)
        rebalancer: Rebalancer = request.app.state.rebalancer
        rebalancer.change(body)
        return JSONResponse(rebalancer.to_dict())
