"""The batched trace writer: the request path submits without waiting; this flushes.

Submissions go into a bounded in-memory queue (``submit`` never blocks and never raises;
when the queue is full the record is counted in ``dropped``). One task drains the queue
in multi-row inserts, flushing when ``batch_size`` records are waiting or
``flush_interval_s`` has passed.

When the database is unreachable, nothing already accepted is lost: the failed batch and
whatever queues up behind it move to a local spool file (off the event loop), which is
replayed in order once the database answers again, and on the next start if the process
stops first. Only a full spool (``spool_max_bytes``) drops records, and they are counted.

What a killed process loses (SIGKILL, a crash, power) is what is only in memory: records
in the queue and in the batch being written. A record waits there from its call's end
until its batch is written: at most ``flush_interval_s`` (0.25 s by default) after the
batch's first record, plus the insert itself; longer while the database is slow or holds
a lock (the batch waits in memory until the write fails and moves to the spool, or ends).
A graceful stop (SIGTERM) writes or spools everything.

The restore after a restart reads the store, so it must not run ahead of this writer:
:meth:`TraceWriter.stored` waits until a trajectory's records, and the spool an earlier
process left, are in the database (gateway/trajectories/restore.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import update
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import TraceSettings
from gateway.store.codec import pack_floats, pack_ids
from gateway.store.models import Call, Trajectory
from gateway.store.records import CallRecord
from gateway.store.spool import Spool

log = logging.getLogger(__name__)
OVERFLOW_MIN = 10_000  #: the overflow's floor, however small the queue (``submit``)


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


_CALL_COLUMNS = [f.name for f in fields(CallRecord) if f.name != "group_id"]


def call_row(rec: CallRecord) -> dict[str, Any]:
    row = {k: getattr(rec, k) for k in _CALL_COLUMNS}
    row["started_at"] = _ts(rec.started_at)
    row["prompt_delta"] = pack_ids(rec.prompt_delta)
    row["completion_ids"] = pack_ids(rec.completion_ids)
    row["completion_logprobs"] = pack_floats(rec.completion_logprobs)
    return row


_JSON_COLUMNS = frozenset({"extra_choices", "request_messages", "weight_segments"})
_TRAJ_UPSERT = ("INSERT INTO trajectories (id, group_id, created_at) VALUES ($1, $2, $3) "
                "ON CONFLICT (id) DO NOTHING")
#: A call of a newer attempt moves the trajectory row on to it (its finish is not yet known).
_TRAJ_BUMP = ("UPDATE trajectories SET attempt = $2, finished_at = NULL, reward = NULL, "
              "metadata = NULL WHERE id = $1 AND attempt < $2")


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
    except asyncpg.DataError as exc:
        raise DataError("COPY calls", None, exc) from exc


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
            .values(attempt=attempt, finished_at=None, reward=None, meta=None))
    calls = sqlite.insert(Call).on_conflict_do_nothing(index_elements=["id"])
    await session.execute(calls, [call_row(r) for r in records])


class TraceWriter:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        settings: TraceSettings,
        spool: Spool | None = None,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._settings = settings
        self._spool = spool
        self._queue: asyncio.Queue[CallRecord] = asyncio.Queue(maxsize=settings.queue_size)
        self._task: asyncio.Task[None] | None = None
        self._pending = 0
        self._inflight: list[CallRecord] = []
        self._overflow: deque[CallRecord] = deque()
        self._overflow_max = max(settings.queue_size, OVERFLOW_MIN)
        self._idle = asyncio.Event()
        self._idle.set()
        self._high_water = asyncio.Event()
        # drain's watermark: records accepted so far, and records the writer has finished
        # with (written, or spilled), counted in the order the writer takes them
        self._accepted = 0
        self._settled = 0
        self._progress = asyncio.Event()
        # for the restore: records accepted and not yet in the database, by trajectory, and
        # whether the spool an earlier process left has been written
        self._unwritten: Counter[str] = Counter()
        self._inherited = asyncio.Event()
        self._landed = asyncio.Event()  # set whenever records reach the database (or are lost)
        self.written = 0
        self.dropped = 0
        self.rejected = 0
        self.spooled = 0
        self.write_errors = 0
        self.db_ok = True
        self.last_error: str | None = None
        self.last_flush_at: float | None = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._overflow)

    @property
    def spool_bytes(self) -> int:
        return self._spool.pending_bytes if self._spool else 0

    def start(self) -> None:
        if self._spool is not None and self._spool.pending_bytes:
            self._idle.clear()
        self._task = asyncio.create_task(self._run(), name="trace-writer")

    def submit(self, record: CallRecord) -> bool:
        """Queue a record without waiting. False (and counted) when it cannot be kept.

        With a spool, a full queue overflows into a second buffer (queue size, at least
        ``OVERFLOW_MIN``) the writer spools at its next chance (it may be stalled in a
        database call); only when that is full too is a record lost, counted and logged.
        """
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            if self._spool is None or len(self._overflow) >= self._overflow_max:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.error("trace queue and overflow full: %d records dropped so far",
                              self.dropped)
                return False
            self._overflow.append(record)
        self._unwritten[record.trajectory_id] += 1
        self._pending += 1
        self._accepted += 1
        self._idle.clear()
        if self._queue.qsize() * 2 >= self._queue.maxsize:
            self._high_water.set()
        return True

    async def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is in the database. False on timeout.

        Records submitted after the call are not waited for: under a steady load the
        writer is rarely idle, and a reader must not wait for calls that ended after it
        asked. (While records sit in the overflow buffer or the spool, their order is not
        the submission order, and this waits for the writer to be idle instead.)
        """
        target = self._accepted
        try:
            async with asyncio.timeout(timeout_s):
                while not self._idle.is_set() and not self._reached(target):
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            return False
        return True

    async def stored(self, trajectory_id: str, *, timeout_s: float) -> bool:
        """Wait until the database holds every record of ``trajectory_id`` this writer
        accepted, and the spool an earlier process left behind. False on timeout.

        A record counts once it is written, or lost for good (rejected by the database,
        or dropped when the spool is full): nothing is left to wait for then."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self._inherited.is_set() or self._unwritten.get(trajectory_id):
                    self._landed.clear()
                    await self._landed.wait()
        except TimeoutError:
            return False
        return True

    def _landed_or_lost(self, records: Sequence[CallRecord]) -> None:
        """``records`` are in the database, or will never be: stop waiting for them.
        (Records replayed from an earlier process's spool were never counted here.)"""
        for rec in records:
            left = self._unwritten.get(rec.trajectory_id, 0)
            if left > 1:
                self._unwritten[rec.trajectory_id] = left - 1
            elif left:
                del self._unwritten[rec.trajectory_id]
        self._landed.set()

    def _reached(self, target: int) -> bool:
        return self._settled >= target and not self._overflow and not self.spool_bytes

    def _settle(self, n: int) -> None:
        self._pending -= n
        self._settled += n
        self._progress.set()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (up to ``timeout_s``); spool the rest; stop."""
        await self.drain(timeout_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        rest = self._inflight + self._take_queued()
        self._inflight = []
        if rest:
            await self._spill(rest)
            log.error("trace writer stopped with %d records not in the database; "
                      "%d bytes spooled for the next start", len(rest), self.spool_bytes)
        if self._spool is not None:  # a spill the cancelled task left running ends first
            await asyncio.to_thread(self._spool.wait_idle)

    def _take_queued(self) -> list[CallRecord]:
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        out += self._overflow
        self._overflow.clear()
        return out

    def _refill(self) -> None:
        """Move overflowed records into the queue as it frees up (order kept)."""
        while self._overflow and not self._queue.full():
            self._queue.put_nowait(self._overflow.popleft())

    async def _next_batch(self) -> list[CallRecord]:
        """The next batch, gathered in ``_inflight`` (where a stop finds it to spool)."""
        self._refill()
        batch = self._inflight = [await self._queue.get()]
        deadline = time.monotonic() + self._settings.flush_interval_s
        while len(batch) < self._settings.batch_size:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except asyncio.QueueEmpty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    batch.append(await self._queue.get())
            except TimeoutError:
                break
        return batch

    async def _run(self) -> None:
        await self._replay_spool()  # what an earlier process left: before anything else
        self._inherited.set()
        self._landed.set()
        self._mark_idle()
        while True:
            batch = await self._next_batch()
            if await self._try_write(batch):
                self._settle(len(batch))
                self._inflight = []
            else:
                await self._spill(batch)  # a stop in the middle spools it again: harmless
                self._inflight = []
                await self._replay_spool()
            self._mark_idle()

    def _mark_idle(self) -> None:
        if self._pending == 0 and not self.spool_bytes:
            self._idle.set()
        self._progress.set()

    async def _try_write(self, batch: Sequence[CallRecord]) -> bool:
        """Write ``batch``; False if the database is unreachable (the batch is not lost)."""
        try:
            async with self._sessionmaker() as session, session.begin():
                await write_batch(session, batch)
        except (IntegrityError, DataError) as exc:
            log.error("trace batch rejected (%s); writing rows one by one", exc)
            await self._write_one_by_one(batch)
            self.last_flush_at = time.time()
            self._landed_or_lost(batch)
            return True
        except Exception as exc:
            self.write_errors += 1
            self.db_ok = False
            self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("trace write failed: %s", self.last_error)
            return False
        self.db_ok = True
        self.written += len(batch)
        self.last_flush_at = time.time()
        self._landed_or_lost(batch)
        return True

    async def _write_one_by_one(self, batch: Sequence[CallRecord]) -> None:
        for rec in batch:
            try:
                async with self._sessionmaker() as session, session.begin():
                    await write_batch(session, [rec])
                self.written += 1
            except (IntegrityError, DataError) as exc:
                self.rejected += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]

    async def _spill(self, records: list[CallRecord]) -> None:
        """Move records to the spool (or, without one, hold them until the DB is back)."""
        if self._spool is None:
            for attempt in itertools.count():
                if await self._try_write(records):
                    break
                await asyncio.sleep(min(self._settings.retry_backoff_s * 2**attempt,
                                        self._settings.retry_backoff_max_s))
            self._settle(len(records))
            return
        kept = await asyncio.to_thread(self._spool.append, records)
        self.spooled += kept
        self._settle(len(records))
        lost = len(records) - kept
        if lost:
            self._landed_or_lost(records[kept:])
            self.dropped += lost
            log.error("trace spool full: dropped %d records", lost)

    async def _replay_spool(self) -> None:
        """Write the spool back in order, spilling the queue while the DB stays down."""
        spool, backoff = self._spool, self._settings.retry_backoff_s
        if spool is None:
            return
        while spool.pending_bytes:
            records, position = await asyncio.to_thread(spool.read, self._settings.batch_size)
            if await self._try_write(records):
                await asyncio.to_thread(spool.commit, position)
                backoff = self._settings.retry_backoff_s
                if self._queue.qsize() * 2 >= self._queue.maxsize:
                    # calls keep coming while the backlog replays: queue them behind it
                    # (order kept) rather than let the memory queue overflow
                    await self._spill(self._take_queued())
                continue
            await self._spill(self._take_queued())
            await self._spill_while_waiting(backoff)
            backoff = min(backoff * 2, self._settings.retry_backoff_max_s)

    async def _spill_while_waiting(self, seconds: float) -> None:
        """Sleep ``seconds``, moving the queue to the spool whenever it fills halfway."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            self._high_water.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._high_water.wait()
            except TimeoutError:
                return
            await self._spill(self._take_queued())
