"""How the trace writer inserts a batch: ``COPY`` on Postgres, multi-row inserts on SQLite.

Both are idempotent by call id, so a batch written twice (its commit reached the database
but the acknowledgement was lost, or a stop spooled a batch the database had taken) is
stored once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import update
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.store.codec import pack_floats, pack_ids
from gateway.store.models import Call, Trajectory
from gateway.store.records import CallRecord
from gateway.store.routes import merge as merge_routes


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


_ROUTE_COLUMNS = ["routes_start", "routes_file", "routes_offset", "routes_length"]
_CALL_COLUMNS = [f.name for f in fields(CallRecord)
                 if f.name not in ("group_id", "routes_ref")] + _ROUTE_COLUMNS


def call_row(rec: CallRecord) -> dict[str, Any]:
    row = {k: getattr(rec, k, None) for k in _CALL_COLUMNS}
    row["started_at"] = _ts(rec.started_at)
    row["prompt_delta"] = pack_ids(rec.prompt_delta)
    row["completion_ids"] = pack_ids(rec.completion_ids)
    row["completion_logprobs"] = pack_floats(rec.completion_logprobs)
    if rec.routes_ref is not None:  # in a segment file (gateway/store/route_files.py)
        row["routes_file"], row["routes_offset"], row["routes_length"], row["routes_start"] \
            = rec.routes_ref
        row["routes"] = None
        return row
    merged = merge_routes(rec.routes) if rec.routes else None
    row["routes_start"], row["routes"] = merged if merged is not None else (None, None)
    return row


_JSON_COLUMNS = frozenset({"extra_choices", "request_messages", "weight_segments"})
_TRAJ_UPSERT = ("INSERT INTO trajectories (id, group_id, created_at) VALUES ($1, $2, $3) "
                "ON CONFLICT (id) DO NOTHING")
#: A call of a newer attempt moves the trajectory row on to it (its finish is not yet known).
_TRAJ_BUMP = ("UPDATE trajectories SET attempt = $2, finished_at = NULL, reward = NULL, "
              "rewards = NULL, metadata = NULL WHERE id = $1 AND attempt < $2")


def _bumps(records: Sequence[CallRecord]) -> dict[str, int]:
    """The newest attempt each reused trajectory id reaches in this batch."""
    out: dict[str, int] = {}
    for rec in records:
        if rec.attempt > out.get(rec.trajectory_id, 0):
            out[rec.trajectory_id] = rec.attempt
    return out


#: The idempotent fallback when COPY meets a call already stored: a batch whose commit
#: reached the database but whose acknowledgement was lost (connection cut mid-commit)
#: is retried from the spool, and must not be rejected as a duplicate.
_CALL_INSERT_IGNORE = (
    f"INSERT INTO calls ({', '.join(_CALL_COLUMNS)}) VALUES "
    f"({', '.join(f'${i + 1}' for i in range(len(_CALL_COLUMNS)))}) ON CONFLICT (id) DO NOTHING")


def _copy_value(column: str, value: Any) -> Any:
    if column in _JSON_COLUMNS and value is not None:
        return orjson.dumps(value).decode()
    return value


#: rows built or encoded per turn of the event loop: a batch is milliseconds of CPU, which
#: in one piece would stall every call in flight (the writer shares the request path's loop)
_ROWS_PER_TURN = 32


async def _paced(rows: Sequence[Any]) -> AsyncIterator[Any]:
    """``rows``, with a turn given to the event loop every ``_ROWS_PER_TURN``."""
    for i, row in enumerate(rows, 1):
        yield row
        if i % _ROWS_PER_TURN == 0:
            await asyncio.sleep(0)


async def _copy_batch(session: AsyncSession, records: Sequence[CallRecord]) -> None:
    """Postgres: a pipelined upsert for the trajectories, ``COPY`` for the calls.

    Several times cheaper per row than an ORM ``executemany``: the writer shares the
    gateway's event loop (and core) with the request path, and gives the loop a turn
    every ``_ROWS_PER_TURN`` rows. Driver errors are re-raised as SQLAlchemy's, so the
    caller's rejected-batch handling is the same on both paths.
    """
    import asyncpg

    conn: Any = (await (await session.connection()).get_raw_connection()).driver_connection
    trajectories: dict[str, tuple[str, str | None, datetime]] = {}
    for rec in records:
        trajectories.setdefault(rec.trajectory_id,
                                (rec.trajectory_id, rec.group_id, _ts(rec.started_at)))
    rows = [tuple(_copy_value(k, v) for k, v in call_row(r).items())
            async for r in _paced(records)]
    try:
        async with conn.transaction():  # SQLAlchemy has not begun one on the raw driver
            await conn.executemany(_TRAJ_UPSERT, list(trajectories.values()))
            if bumps := _bumps(records):
                await conn.executemany(_TRAJ_BUMP, list(bumps.items()))
            try:
                async with conn.transaction():  # a savepoint
                    await conn.copy_records_to_table("calls", records=_paced(rows),
                                                     columns=_CALL_COLUMNS)
            except asyncpg.UniqueViolationError:
                await conn.executemany(_CALL_INSERT_IGNORE, rows)
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError("COPY calls", None, exc) from exc
    except (asyncpg.DataError, asyncpg.ProgramLimitExceededError) as exc:
        raise DataError("COPY calls", None, exc) from exc


def record_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by :func:`write_batch`, is the records' fault (the database
    refused a value or a constraint, or a value could not be encoded), as opposed to the
    database's (unreachable, failing, timed out). Retrying the first never helps: the
    writer writes the batch row by row and quarantines the culprits; it retries the
    second, holding the records meanwhile."""
    if isinstance(exc, IntegrityError | DataError):
        return True
    if isinstance(exc, DBAPIError | OSError | ConnectionError | TimeoutError):
        return False
    # an encoder's refusal (orjson's depth limit, an id past int32, a lone surrogate)
    return isinstance(exc, TypeError | ValueError | OverflowError | RecursionError)


async def write_batch(session: AsyncSession, records: Sequence[CallRecord]) -> None:
    """Insert one batch: the trajectories it touches (if new), then its calls."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        await _copy_batch(session, records)
        return
    trajectories: dict[str, dict[str, Any]] = {}
    for rec in records:
        trajectories.setdefault(
            rec.trajectory_id,
            {"id": rec.trajectory_id, "group_id": rec.group_id, "created_at": _ts(rec.started_at)},
        )
    stmt = sqlite.insert(Trajectory).on_conflict_do_nothing(index_elements=["id"])
    await session.execute(stmt, list(trajectories.values()))
    for tid, attempt in _bumps(records).items():
        await session.execute(
            update(Trajectory).where(Trajectory.id == tid, Trajectory.attempt < attempt)
            .values(attempt=attempt, finished_at=None, reward=None, rewards=None, meta=None))
    calls = sqlite.insert(Call).on_conflict_do_nothing(index_elements=["id"])
    await session.execute(calls, [call_row(r) for r in records])
