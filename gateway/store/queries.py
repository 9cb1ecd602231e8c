"""Query functions: the session is passed in, keyword-only; they flush, never commit."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer
from sqlalchemy.orm.attributes import set_committed_value

from gateway.store.db import route_files_of
from gateway.store.models import Call, Trajectory, TrajectoryAttempt
from gateway.store.route_files import RouteRef


@dataclass(frozen=True, slots=True)
class TrajectorySummary:
    trajectory: Trajectory
    calls: int
    completion_tokens: int
    last_call_at: datetime | None


#: what ``GET /trajectories`` may be ordered by (``-`` first: descending)
Order = Literal["created", "-created", "reward", "-reward", "tokens", "-tokens"]


@dataclass(frozen=True, slots=True)
class TrajectoryFilter:
    """What a trajectory search asks for; None everywhere lists every trajectory."""

    group_id: str | None = None
    finished: bool | None = None
    id_contains: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    min_tokens: int | None = None  # completion tokens over the trajectory's calls
    max_tokens: int | None = None
    weight_version: str | None = None  # a call of it ran on this version
    model: str | None = None  # a call of it asked for this policy
    order: Order = "created"


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


async def list_trajectories(
    session: AsyncSession, *, where: TrajectoryFilter | None = None, limit: int = 100,
    offset: int = 0,
) -> list[TrajectorySummary]:
    f = where or TrajectoryFilter()
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
    tokens = func.coalesce(stats.c.completion_tokens, 0)
    stmt = select(Trajectory, stats.c.calls, stats.c.completion_tokens, stats.c.last_call_at)
    stmt = stmt.outerjoin(stats, stats.c.trajectory_id == Trajectory.id)
    if f.group_id is not None:
        stmt = stmt.where(Trajectory.group_id == f.group_id)
    if f.finished is not None:
        cond = Trajectory.finished_at.is_not(None)
        stmt = stmt.where(cond if f.finished else ~cond)
    if f.id_contains:
        stmt = stmt.where(Trajectory.id.ilike(_like(f.id_contains), escape="\\"))
    if f.min_reward is not None:
        stmt = stmt.where(Trajectory.reward >= f.min_reward)
    if f.max_reward is not None:
        stmt = stmt.where(Trajectory.reward <= f.max_reward)
    if f.min_tokens is not None:
        stmt = stmt.where(tokens >= f.min_tokens)
    if f.max_tokens is not None:
        stmt = stmt.where(tokens <= f.max_tokens)
    for column, value in ((Call.weight_version, f.weight_version), (Call.model, f.model)):
        if value is not None:
            stmt = stmt.where(select(Call.id).where(
                Call.trajectory_id == Trajectory.id, column == value).exists())
    key = {"created": Trajectory.created_at, "reward": Trajectory.reward,
           "tokens": tokens}[f.order.lstrip("-")]
    first = key.desc() if f.order.startswith("-") else key.asc()
    stmt = stmt.order_by(first.nulls_last(), Trajectory.created_at, Trajectory.id)
    rows = (await session.execute(stmt.limit(limit).offset(offset))).all()
    return [TrajectorySummary(t, c or 0, int(tok or 0), last) for t, c, tok, last in rows]


async def group_trajectories(session: AsyncSession, *, group_id: str, limit: int
                             ) -> Sequence[Trajectory]:
    """A group's trajectories, oldest first."""
    stmt = (select(Trajectory).where(Trajectory.group_id == group_id)
            .order_by(Trajectory.created_at, Trajectory.id).limit(limit))
    return (await session.scalars(stmt)).all()


async def get_trajectory(session: AsyncSession, *, trajectory_id: str) -> Trajectory | None:
    return await session.get(Trajectory, trajectory_id)


async def get_calls(
    session: AsyncSession, *, trajectory_id: str, attempt: int | None = None,
    routes: bool = True,
) -> Sequence[Call]:
    """A trajectory's calls in order: of one attempt, or of all (by attempt, then seq);
    with ``routes`` each call's routed experts in ``Call.routes``, read from its segment
    file where they lie in one (:func:`load_routes`); without, not read (the bulk of a MoE
    call, left unloaded: reading ``Call.routes`` then raises)."""
    stmt = select(Call).where(Call.trajectory_id == trajectory_id)
    if not routes:
        stmt = stmt.options(defer(Call.routes, raiseload=True))
    if attempt is not None:
        stmt = stmt.where(Call.attempt == attempt)
    stmt = stmt.order_by(Call.attempt, Call.seq, Call.started_at)
    calls = (await session.scalars(stmt)).all()
    if routes:
        await load_routes(session, calls)
    return calls


async def load_routes(session: AsyncSession, calls: Sequence[Call]) -> None:
    """Put the routed experts of ``calls`` that lie in segment files into ``Call.routes``
    (as loaded, not as a change to write), read off the event loop. A segment the
    retention deleted, or a store without its directory, leaves them None (unknown)."""
    filed = [c for c in calls if c.routes_file is not None and c.routes is None]
    files = route_files_of(session)
    if not filed or files is None:
        return
    refs = [RouteRef(c.routes_file or "", c.routes_offset or 0, c.routes_length or 0)
            for c in filed]
    found = await asyncio.to_thread(lambda: [files.read(r) for r in refs])
    for call, data in zip(filed, found, strict=True):
        set_committed_value(call, "routes", data)


async def get_attempt(
    session: AsyncSession, *, trajectory_id: str, attempt: int
) -> TrajectoryAttempt | None:
    return await session.get(TrajectoryAttempt, (trajectory_id, attempt))


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """What the store knows of a trajectory's latest attempt (to resume after a restart)."""

    trajectory: Trajectory
    attempt: int
    finished: bool
    calls: Sequence[Call]


async def known_trajectories(session: AsyncSession, ids: Sequence[str]) -> set[str]:
    """Which of ``ids`` the store has a trajectory row for (one query for all of them)."""
    rows = await session.scalars(select(Trajectory.id).where(Trajectory.id.in_(ids)))
    return set(rows)


async def restore_point(session: AsyncSession, *, trajectory_id: str) -> RestorePoint | None:
    traj = await session.get(Trajectory, trajectory_id)
    if traj is None:
        return None
    latest = await session.scalar(
        select(func.max(Call.attempt)).where(Call.trajectory_id == trajectory_id))
    attempt = max(traj.attempt, latest or 0)
    finished = traj.finished_at is not None and traj.attempt == attempt
    calls = await get_calls(session, trajectory_id=trajectory_id, attempt=attempt, routes=False)
    return RestorePoint(traj, attempt, finished, calls)


async def finish_trajectory(
    session: AsyncSession,
    *,
    trajectory_id: str,
    group_id: str | None,
    reward: float | None,
    metadata: dict[str, Any] | None,
    now: float,
    attempt: int | None = None,
    rewards: dict[str, float] | None = None,
) -> Trajectory:
    """Mark an attempt finished with a reward (default: the row's current attempt), and
    with ``rewards``, each policy's own by model name; creates the row if no call was
    recorded yet. The attempt's own record is kept in ``trajectory_attempts`` so a later
    reuse of the id does not lose it."""
    dialect = session.get_bind().dialect.name
    ins = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stamp = datetime.fromtimestamp(now, tz=UTC)
    if attempt is None:
        attempt = await session.scalar(
            select(Trajectory.attempt).where(Trajectory.id == trajectory_id)) or 0
    stmt = ins(Trajectory).values(
        id=trajectory_id, group_id=group_id, created_at=stamp, finished_at=stamp,
        reward=reward, meta=metadata, attempt=attempt, rewards=rewards,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["id"],
        set_={"finished_at": stamp, "reward": reward, "metadata": metadata,
              "attempt": attempt, "rewards": rewards},
    )
    await session.execute(stmt)
    rec = ins(TrajectoryAttempt).values(trajectory_id=trajectory_id, attempt=attempt,
                                        finished_at=stamp, reward=reward, meta=metadata,
                                        rewards=rewards)
    rec = rec.on_conflict_do_update(
        index_elements=["trajectory_id", "attempt"],
        set_={"finished_at": stamp, "reward": reward, "metadata": metadata,
              "rewards": rewards})
    await session.execute(rec)
    await session.flush()
    row = await session.get(Trajectory, trajectory_id, populate_existing=True)
    assert row is not None
    return row


async def finished_trajectory_ids(
    session: AsyncSession, *, group_id: str | None = None, limit: int | None = None
) -> list[str]:
    """Ids whose latest attempt finished, oldest first; an attempt the trainer aborted
    (``metadata.aborted``, gateway/weights/aborts.py) is not a finished trajectory here."""
    stmt = select(Trajectory.id, Trajectory.meta).where(Trajectory.finished_at.is_not(None))
    if group_id is not None:
        stmt = stmt.where(Trajectory.group_id == group_id)
    stmt = stmt.order_by(Trajectory.finished_at, Trajectory.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    rows = (await session.execute(stmt)).all()
    return [tid for tid, meta in rows if not (isinstance(meta, dict) and "aborted" in meta)]
