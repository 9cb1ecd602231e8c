"""The batched trace writer: the request path submits without waiting; this flushes.

Submissions go into a bounded queue (``submit`` never blocks and never raises; when the
queue is full the record is counted in ``dropped``). One task drains the queue in
multi-row inserts, flushing when ``batch_size`` records are waiting or
``flush_interval_s`` has passed. A batch that fails to write (database down) is kept and
retried with backoff, so nothing already accepted is lost while the database recovers.
``close`` flushes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import TraceSettings
from gateway.store.codec import pack_floats, pack_ids
from gateway.store.models import Call, Trajectory
from gateway.store.records import CallRecord

log = logging.getLogger(__name__)


def _ts(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def call_row(rec: CallRecord) -> dict[str, Any]:
    return {
        "id": rec.id,
        "trajectory_id": rec.trajectory_id,
        "seq": rec.seq,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "backend_id": rec.backend_id,
        "backend_url": rec.backend_url,
        "tp": rec.tp,
        "weight_version": rec.weight_version,
        "status": rec.status,
        "error": rec.error,
        "finish_reason": rec.finish_reason,
        "started_at": _ts(rec.started_at),
        "queued_ms": rec.queued_ms,
        "ttft_ms": rec.ttft_ms,
        "total_ms": rec.total_ms,
        "prompt_len": rec.prompt_len,
        "prompt_offset": rec.prompt_offset,
        "prompt_delta": pack_ids(rec.prompt_delta),
        "completion_ids": pack_ids(rec.completion_ids),
        "completion_logprobs": pack_floats(rec.completion_logprobs),
        "mismatch_pos": rec.mismatch_pos,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "extra_choices": rec.extra_choices,
        "request_messages": rec.request_messages,
        "completion_text": rec.completion_text,
    }


async def write_batch(session: AsyncSession, records: Sequence[CallRecord]) -> None:
    """Insert one batch: the trajectories it touches (if new), then its calls."""
    dialect = session.get_bind().dialect.name
    ins = postgresql.insert if dialect == "postgresql" else sqlite.insert
    trajectories: dict[str, dict[str, Any]] = {}
    for rec in records:
        trajectories.setdefault(
            rec.trajectory_id,
            {"id": rec.trajectory_id, "group_id": rec.group_id, "created_at": _ts(rec.started_at)},
        )
    stmt = ins(Trajectory).on_conflict_do_nothing(index_elements=["id"])
    await session.execute(stmt, list(trajectories.values()))
    await session.execute(insert(Call), [call_row(r) for r in records])


class TraceWriter:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], settings: TraceSettings
    ) -> None:
        self._sessionmaker = sessionmaker
        self._settings = settings
        self._queue: asyncio.Queue[CallRecord] = asyncio.Queue(maxsize=settings.queue_size)
        self._task: asyncio.Task[None] | None = None
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.written = 0
        self.dropped = 0
        self.write_errors = 0
        self.rejected = 0
        self.last_error: str | None = None
        self.last_flush_at: float | None = None

    @property
    def queue_depth(self) -> int:
        return self._pending

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="trace-writer")

    def submit(self, record: CallRecord) -> bool:
        """Queue a record without waiting. False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        self._pending += 1
        self._idle.clear()
        return True

    async def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is written. False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (up to ``timeout_s``), then stop."""
        await self.drain(timeout_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._pending:
            log.error("trace writer closed with %d records unwritten", self._pending)

    async def _next_batch(self) -> list[CallRecord]:
        batch = [await self._queue.get()]
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
        while True:
            batch = await self._next_batch()
            await self._write_with_retry(batch)
            self._pending -= len(batch)
            self.written += len(batch)
            self.last_flush_at = time.time()
            if self._pending == 0:
                self._idle.set()

    async def _write_with_retry(self, batch: list[CallRecord]) -> None:
        backoff = self._settings.retry_backoff_s
        while True:
            try:
                async with self._sessionmaker() as session, session.begin():
                    await write_batch(session, batch)
                return
            except (IntegrityError, DataError) as exc:
                # The data, not the database, is at fault: isolate the bad rows.
                log.error("trace batch rejected (%s); writing rows one by one", exc)
                await self._write_one_by_one(batch)
                return
            except Exception as exc:
                self.write_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("trace write failed (%s); retrying in %.1fs", self.last_error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _write_one_by_one(self, batch: list[CallRecord]) -> None:
        for rec in batch:
            try:
                async with self._sessionmaker() as session, session.begin():
                    await write_batch(session, [rec])
            except (IntegrityError, DataError) as exc:
                self.rejected += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
