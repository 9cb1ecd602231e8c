"""Routed experts kept for as long as a trainer needs them, then dropped from the store.

Routes are ~50 times the bytes of the tokens they describe (384 B a position for
Qwen3-30B-A3B; docs/moe.md): a pool of 64 GPUs at 3,000 tokens/s each records about
150 MB of them a second, 0.5 TB an hour, while a trainer reads a step's samples minutes
after its calls. With ``traces.routes_retention_s`` set, :class:`RoutesRetention` clears
``calls.routes`` of every call of a trajectory whose calls all started longer ago than
that (a long trajectory keeps its first calls' routes while it runs), in batches of
``BATCH`` rows (short transactions beside the trace writer's), every little while; the
calls' tokens, logprobs and everything else stay. A sample built afterwards has
``routed_experts`` null, or ``-1`` on the positions whose routes went.

Postgres frees the TOAST pages of the cleared values to its free space map at the next
(auto)vacuum, where the next routes are written; SQLite reuses its freed pages
(``VACUUM`` gives them back to the disk). In a sharded gateway the shards share the
store and one owns this job: shard 0 (:func:`gateway.shards.launch.shard_env`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import aliased

from gateway.loops import Periodic
from gateway.store.models import Call

log = logging.getLogger(__name__)
#: rows cleared per transaction
BATCH = 1_000
#: how often the store is looked at, at most (a tenth of the retention if shorter)
CHECK_EVERY_S = 300.0


async def drop_routes_before(session: AsyncSession, *, cutoff: datetime,
                             limit: int = BATCH) -> int:
    """Clear the routes of up to ``limit`` calls that started before ``cutoff`` of
    trajectories with no call since (one still running keeps all its routes until it is
    trained on); how many. The calls holding routes are found by their partial index."""
    later = aliased(Call)
    ids = (await session.scalars(
        select(Call.id).where(
            Call.routes.is_not(None), Call.started_at < cutoff,
            ~select(later.id).where(later.trajectory_id == Call.trajectory_id,
                                    later.started_at >= cutoff).exists())
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
                 *, clock: Callable[[], float] = time.time) -> None:
        self.sessionmaker = sessionmaker
        self.retention_s = retention_s
        self.clock = clock
        self.dropped = 0  # calls whose routes this process cleared
        self.loop = Periodic("routes-retention", self._step,
                             min(CHECK_EVERY_S, max(1.0, retention_s / 10)), logger=log)

    def start(self) -> None:
        self.loop.start()

    async def close(self) -> None:
        await self.loop.close()

    async def _step(self) -> None:
        await self.step()

    async def step(self) -> int:
        """One pass: clear the routes of every call older than the retention; how many."""
        cutoff = datetime.fromtimestamp(self.clock() - self.retention_s, tz=UTC)
        total = 0
        while True:
            async with self.sessionmaker() as session, session.begin():
                n = await drop_routes_before(session, cutoff=cutoff)
            total += n
            if n < BATCH:
                break
        if total:
            self.dropped += total
            log.info("cleared the routed experts of %d calls older than %g s (their tokens "
                     "are kept)", total, self.retention_s)
        return total
