"""Routed experts kept for as long as a trainer needs them, then dropped from the store.

Routes are ~50 times the bytes of the tokens they describe (384 B a position for
Qwen3-30B-A3B; docs/moe.md): a pool of 64 GPUs at 3,000 tokens/s each records about
150 MB of them a second, 0.5 TB an hour, while a trainer reads a step's samples minutes
after its calls. With ``traces.routes_retention_s`` set, :class:`RoutesRetention` drops
the routes of every call of a trajectory whose calls all started longer ago than that (a
long trajectory keeps its first calls' routes while it runs), every little while; the
calls' tokens, logprobs and everything else stay. A sample built afterwards has
``routed_experts`` null, or ``-1`` on the positions whose routes went.

Routes in segment files (:mod:`gateway.store.route_files`, the default) go a segment at a
time: once a segment holds only calls older than the retention, the few of its calls whose
trajectory is still running are copied into a current segment, the others' references
cleared, and the file deleted: its disk space is back at once. Routes in the calls' rows
(``traces.routes_store`` ``database``, or rows from before the files) are cleared in
batches of ``BATCH`` rows (short transactions beside the trace writer's); Postgres hands
their TOAST pages to its free space map at the next (auto)vacuum, SQLite reuses its freed
pages. In a sharded gateway the shards share the store and one owns this job: shard 0
(:func:`gateway.shards.launch.shard_env`); it deletes the sealed segments of every shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import aliased

from gateway.loops import Periodic
from gateway.store.models import Call
from gateway.store.route_files import RouteFiles, RouteRef

log = logging.getLogger(__name__)
#: rows cleared per transaction
BATCH = 1_000
#: how often the store is looked at, at most (a tenth of the retention if shorter)
CHECK_EVERY_S = 300.0


def _running_since(cutoff: datetime) -> Any:
    """Calls whose trajectory has a call that started at or after ``cutoff``."""
    later = aliased(Call)
    return select(later.id).where(later.trajectory_id == Call.trajectory_id,
                                  later.started_at >= cutoff).exists()


async def expire_segment(session: AsyncSession, files: RouteFiles, segment: str, *,
                         cutoff: datetime) -> tuple[int, int]:
    """Drop ``segment``'s references, copying first into a current segment the routes of
    its calls whose trajectory is still running (a call since ``cutoff``); (dropped,
    copied). The caller commits, then deletes the file."""
    keep = (await session.execute(
        select(Call.id, Call.routes_offset, Call.routes_length)
        .where(Call.routes_file == segment, _running_since(cutoff)))).all()
    copied = 0
    if keep:
        refs = {call_id: RouteRef(segment, off or 0, n or 0) for call_id, off, n in keep}

        def copy() -> dict[str, RouteRef]:
            data = {k: d for k, r in refs.items() if (d := files.read(r)) is not None}
            return dict(zip(data, files.append(list(data.values())), strict=True))

        moved = await asyncio.to_thread(copy)
        for call_id, new in moved.items():  # the rest are cleared below, with the others
            await session.execute(update(Call).where(Call.id == call_id).values(
                routes_file=new.segment, routes_offset=new.offset, routes_length=new.length))
        copied = len(moved)
    result = await session.execute(
        update(Call).where(Call.routes_file == segment)
        .values(routes_file=None, routes_offset=None, routes_length=None, routes_start=None))
    dropped = cast(CursorResult[Any], result).rowcount
    await session.flush()
    return int(dropped or 0), copied


async def drop_routes_before(session: AsyncSession, *, cutoff: datetime,
                             limit: int = BATCH) -> int:
    """Clear the routes of up to ``limit`` calls that started before ``cutoff`` of
    trajectories with no call since (one still running keeps all its routes until it is
    trained on); how many. The calls holding routes are found by their partial index."""
    ids = (await session.scalars(
        select(Call.id).where(Call.routes.is_not(None), Call.started_at < cutoff,
                              ~_running_since(cutoff))
        .limit(limit))).all()
    if ids:
        await session.execute(update(Call).where(Call.id.in_(ids))
                              .values(routes=None, routes_start=None))
        await session.flush()
    return len(ids)


class RoutesRetention:
    """Drops routes older than ``retention_s`` every little while (module doc);
    ``clock`` is wall time, as the calls' ``started_at``."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], retention_s: float,
                 *, files: RouteFiles | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.sessionmaker = sessionmaker
        self.retention_s = retention_s
        self.files = files
        self.clock = clock
        self.dropped = 0  # calls whose routes this process cleared
        self.segments_deleted = 0
        self.loop = Periodic("routes-retention", self._step,
                             min(CHECK_EVERY_S, max(1.0, retention_s / 10)), logger=log)

    def start(self) -> None:
        self.loop.start()

    async def close(self) -> None:
        await self.loop.close()

    async def _step(self) -> None:
        await self.step()

    async def step(self) -> int:
        """One pass: drop the routes of every call older than the retention; how many."""
        now = self.clock()
        cutoff = datetime.fromtimestamp(now - self.retention_s, tz=UTC)
        total = 0
        if self.files is not None:
            total += await self._expire_segments(now - self.retention_s, cutoff)
        while True:
            async with self.sessionmaker() as session, session.begin():
                n = await drop_routes_before(session, cutoff=cutoff)
            total += n
            if n < BATCH:
                break
        if total:
            self.dropped += total
            self.log_dropped(total)
        return total

    async def _expire_segments(self, before: float, cutoff: datetime) -> int:
        """Every sealed segment written only before ``before``: its running calls' routes
        copied on, its references dropped (committed), then its file deleted."""
        assert self.files is not None
        files, total = self.files, 0
        for segment in await asyncio.to_thread(files.sealed_before, before):
            async with self.sessionmaker() as session, session.begin():
                dropped, copied = await expire_segment(session, files, segment,
                                                       cutoff=cutoff)
            await asyncio.to_thread(files.delete, segment)
            self.segments_deleted += 1
            total += dropped
            if copied:
                log.info("kept the routed experts of %d calls of running trajectories from "
                         "segment %s, deleted", copied, segment)
        return total

    def log_dropped(self, total: int) -> None:
        log.info("cleared the routed experts of %d calls older than %g s (their tokens are "
                 "kept)", total, self.retention_s)
