"""The batched trace writer: the request path submits without waiting; this flushes.

Submissions go into a bounded in-memory queue (``submit`` never blocks and never raises;
when the queue is full the record is counted in ``dropped``). One task drains the queue
in multi-row inserts (``gateway.store.inserts``), flushing when ``batch_size`` records
are waiting or ``flush_interval_s`` has passed. It runs when records arrive, not on a
period, so it is not a :class:`gateway.loops.Periodic`; like one, it logs if it ever
stops before ``close()``.

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
from collections.abc import Sequence

from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import TraceSettings
from gateway.loops import report_unexpected_end
from gateway.store.inserts import write_batch
from gateway.store.records import CallRecord
from gateway.store.spool import Spool

log = logging.getLogger(__name__)
OVERFLOW_MIN = 10_000  #: the overflow's floor, however small the queue (``submit``)


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
        self._closing = False
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
        report_unexpected_end(self._task, log, lambda: self._closing)

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
        self._closing = True
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
