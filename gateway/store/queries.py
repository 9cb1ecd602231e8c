"""Query functions: the session is passed in, keyword-only; they flush, never commit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.models import Call, Trajectory


@dataclass(frozen=True, slots=True)
class TrajectorySummary:
    trajectory: Trajectory
    calls: int
    completion_tokens: int
    last_call_at: datetime | None


async def list_trajectories(
    session: AsyncSession,
    *,
    group_id: str | None = None,
    finished: bool | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[TrajectorySummary]:
    stats = (
        select(
            Call.trajectory_id,
            func.count().label("calls"),
            func.coalesce(func.sum(Call.completion_tokens), 0).label("completion_tokens"),
            func.max(Call.started_at).label("last_call_at"),
        )
        .group_by(Call.trajectory_id)
        .subquery()
    )
    stmt = select(Trajectory, stats.c.calls, stats.c.completion_tokens, stats.c.last_call_at)
    stmt = stmt.outerjoin(stats, stats.c.trajectory_id == Trajectory.id)
    if group_id is not None:
        stmt = stmt.where(Trajectory.group_id == group_id)
    if finished is not None:
        cond = Trajectory.finished_at.is_not(None)
        stmt = stmt.where(cond if finished else ~cond)
    stmt = stmt.order_by(Trajectory.created_at, Trajectory.id).limit(limit).offset(offset)
    rows = (await session.execute(stmt)).all()
    return [TrajectorySummary(t, c or 0, int(tok or 0), last) for t, c, tok, last in rows]


async def get_trajectory(session: AsyncSession, *, trajectory_id: str) -> Trajectory | None:
    return await session.get(Trajectory, trajectory_id)


async def get_calls(session: AsyncSession, *, trajectory_id: str) -> Sequence[Call]:
    stmt = (
        select(Call)
        .where(Call.trajectory_id == trajectory_id)
        .order_by(Call.seq, Call.started_at)
    )
    return (await session.scalars(stmt)).all()


async def finish_trajectory(
    session: AsyncSession,
    *,
    trajectory_id: str,
    group_id: str | None,
    reward: float | None,
    metadata: dict[str, Any] | None,
    now: float,
) -> Trajectory:
    """Mark finished with a reward; creates the row if no call was recorded yet."""
    dialect = session.get_bind().dialect.name
    ins = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stamp = datetime.fromtimestamp(now, tz=UTC)
    stmt = ins(Trajectory).values(
        id=trajectory_id, group_id=group_id, created_at=stamp, finished_at=stamp,
        reward=reward, meta=metadata,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["id"],
        set_={"finished_at": stamp, "reward": reward, "metadata": metadata},
    )
    await session.execute(stmt)
    await session.flush()
    row = await session.get(Trajectory, trajectory_id, populate_existing=True)
    assert row is not None
    return row


async def finished_trajectory_ids(
    session: AsyncSession, *, group_id: str | None = None, limit: int | None = None
) -> list[str]:
    stmt = select(Trajectory.id).where(Trajectory.finished_at.is_not(None))
    if group_id is not None:
        stmt = stmt.where(Trajectory.group_id == group_id)
    stmt = stmt.order_by(Trajectory.finished_at, Trajectory.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list((await session.scalars(stmt)).all())
