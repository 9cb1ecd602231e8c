"""The batched trace writer: the request path submits without waiting; this flushes.

Submissions go into a bounded in-memory queue (``submit`` never blocks and never raises).
One task drains the queue in multi-row inserts (``gateway.store.inserts``), flushing when
``batch_size`` records are waiting or ``flush_interval_s`` has passed. It runs when
records arrive, not on a period, so it is not a :class:`gateway.loops.Periodic`.

Nothing accepted is lost silently:

- the database unreachable: the failed batch and whatever queues up behind it move to the
  process's spool file (off the event loop), replayed in order once the database answers
  again, and on the next start if the process stops first;
- the spool unable to take them (full, a full or read-only disk): they stay in memory
  (``queue_size + overflow_size`` records) and are retried; once memory has no room left
  for the calls in flight, the gateway refuses model calls (:attr:`TraceWriter.refusal`)
  instead of answering calls it could not record (what still cannot be kept is counted
  by reason in ``lost``);
- a record the database rejects, or that cannot be encoded or decoded, is quarantined
  (:mod:`gateway.store.quarantine`): kept on disk, counted, logged, never the reason the
  writer stops;
- the writer's loop is supervised: an unexpected exception is logged, the batch it was
  writing quarantined, and the loop restarted after a backoff; model calls are refused
  while it is down, and ``/ready``, ``/status`` and ``/metrics`` say so.

What a killed process loses (SIGKILL, a crash, power) is what is only in memory: records
in the queue and in the batch being written. A record waits there from its call's end
until its batch is written: at most ``flush_interval_s`` (0.25 s by default) after the
batch's first record, plus the insert itself; longer while the database is slow or holds
a lock. A graceful stop (SIGTERM) writes or spools everything it can.

The restore after a restart reads the store, so it must not run ahead of this writer:
:meth:`TraceWriter.stored` waits until a trajectory's records, and the spools an earlier
process left, are in the database (gateway/trajectories/restore.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.config import TraceSettings
from gateway.loops import ERROR_EVERY_S, RateLimit, report_unexpected_end
from gateway.store.inserts import record_fault, write_batch
from gateway.store.ledger import WriterLedger
from gateway.store.quarantine import Quarantine
from gateway.store.records import CallRecord
from gateway.store.route_files import RouteFiles
from gateway.store.routes import RouteWriter
from gateway.store.spool import Spool

log = logging.getLogger(__name__)
#: a supervised run that lasted this long resets the restart backoff
HEALTHY_RUN_S = 60.0


class TraceWriter(WriterLedger):
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        settings: TraceSettings,
        spool: Spool | None = None,
        *,
        orphans: Sequence[Spool] = (),
        route_files: RouteFiles | None = None,
    ) -> None:
        super().__init__()
        self._sessionmaker = sessionmaker
        #: routed experts to segment files (None: they go into the calls' rows)
        self.routes = RouteWriter(route_files) if route_files is not None else None
        self._settings = settings
        self._spool = spool
        self._orphans = list(orphans)  # spools of stopped processes, replayed first
        self.quarantine: Quarantine | None = spool.quarantine if spool else None
        self._queue: asyncio.Queue[CallRecord] = asyncio.Queue(maxsize=settings.queue_size)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._inflight: list[CallRecord] = []
        self._replaying: tuple[Spool, list[CallRecord], int] | None = None
        self._overflow: deque[CallRecord] = deque()  # past the queue, while it is full
        self._held: deque[CallRecord] = deque()  # the spool refused them: retried first
        self._overflow_max = settings.overflow_size
        self._high_water = asyncio.Event()
        self._backoff = settings.retry_backoff_s
        self._spool_log = RateLimit(ERROR_EVERY_S)
        self._routes_log = RateLimit(ERROR_EVERY_S)
        #: records whose routed experts were left out because the writer was behind
        self.routes_dropped = 0
        #: calls admitted and not yet submitted (the proxy's count): refusing new calls
        #: while memory still has room for theirs means none of them is lost
        self.calls_in_flight: Callable[[], int] = lambda: 0

    @property
    def routes_unwritten(self) -> int:
        """Records whose routed experts the segment files could not take (a full disk)."""
        return self.routes.unwritten if self.routes is not None else 0

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + len(self._overflow) + len(self._held)

    @property
    def spool_bytes(self) -> int:
        spools = ([self._spool] if self._spool else []) + self._orphans
        return sum(s.pending_bytes for s in spools)

    def _backlog(self) -> bool:
        return bool(self._overflow or self._held or self.spool_bytes)

    @property
    def memory_full(self) -> bool:
        """Records in memory (queued, overflowed, held, in the batch) are at their bound."""
        return self._in_memory() >= self._queue.maxsize + self._overflow_max

    def _in_memory(self) -> int:
        return self.queue_depth + len(self._inflight)

    @property
    def refusal(self) -> str | None:
        """Why model calls must be refused now (the writer could not record them), or None."""
        if self._task is None or self._closing:
            return None  # not started (embedded, tests) or stopping: the lifespan decides
        if self._task.done():
            return f"the trace writer stopped ({self.failure or 'cancelled'})"
        if not self.running:
            return (f"the trace writer failed ({self.failure}) and restarts in a moment; "
                    "calls are refused until it records again")
        room = self._queue.maxsize + self._overflow_max - self._in_memory()
        if room <= self.calls_in_flight():  # each will bring a record: keep room for them
            return ("the trace buffer is full: the database is unreachable and the spool "
                    f"cannot take more ({self.spool_error or self.last_error})")
        return None

    def start(self) -> None:
        if self.spool_bytes:
            self._idle.clear()
        self._task = asyncio.create_task(self._supervise(), name="trace-writer")
        report_unexpected_end(self._task, log, lambda: self._closing)

    def submit(self, record: CallRecord) -> bool:
        """Queue a record without waiting. False (and counted) when it cannot be kept.

        A full queue overflows into a second buffer (``overflow_size``) the writer takes
        at its next chance (it may be stalled in a database call); only when that is full
        too is a record lost, counted and logged."""
        if self.memory_full:
            self.lose("memory_full", 1)
            return False
        if record.routes and self.queue_depth >= self._settings.routes_backlog:
            record.routes = None  # behind: the routes would pile up in memory
            self.routes_dropped += 1
            if self._routes_log.ready(time.monotonic()):
                log.warning("the trace writer is %d records behind: routed experts left "
                            "out of new records (%d so far); their tokens are kept",
                            self.queue_depth, self.routes_dropped)
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self._overflow.append(record)
        self._accept(record)
        if self._queue.qsize() * 2 >= self._queue.maxsize:
            self._high_water.set()
        return True

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
            await self._spill(rest, final=True)
            log.error("trace writer stopped with %d records not in the database; "
                      "%d bytes spooled for the next start", len(rest), self.spool_bytes)
        for spool in ([self._spool] if self._spool else []) + self._orphans:
            await asyncio.to_thread(spool.close)  # after a spill the cancel left running

    def _take_queued(self) -> list[CallRecord]:
        out = list(self._held)
        self._held.clear()
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
        """The next batch, gathered in ``_inflight`` (where a stop finds it to spool):
        records the spool refused first, then the queue."""
        size = self._settings.batch_size
        if self._held:
            batch = self._inflight = [self._held.popleft()
                                      for _ in range(min(size, len(self._held)))]
            return batch
        self._refill()
        batch = self._inflight = [await self._queue.get()]
        deadline = time.monotonic() + self._settings.flush_interval_s
        while len(batch) < size:
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

    async def _supervise(self) -> None:
        """Run the writer's loop; restart it (after a backoff) whenever it fails."""
        backoff = self._settings.retry_backoff_s
        while True:
            started = time.monotonic()
            try:
                await self._run()
            except Exception as exc:
                self.running = False
                self.restarts += 1
                self.failure = f"{type(exc).__name__}: {exc}"[:500]
                if time.monotonic() - started > HEALTHY_RUN_S:
                    backoff = self._settings.retry_backoff_s
                log.exception("trace writer failed; quarantining the batch it held and "
                              "restarting in %.1f s (model calls are refused until then)",
                              backoff)
                await self._quarantine_unfinished(self.failure)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._settings.retry_backoff_max_s)
                self.running = True

    async def _quarantine_unfinished(self, reason: str) -> None:
        """The batch (or spool chunk) a failed loop held: out of the way, never lost, so
        the same record cannot fail the loop again."""
        batch, self._inflight = self._inflight, []
        chunk, self._replaying = self._replaying, None
        await self._quarantine("writer_failure", reason, batch + (chunk[1] if chunk else []))
        if chunk is not None:
            await asyncio.to_thread(chunk[0].commit, chunk[2])
        self._settle(len(batch))

    async def _quarantine(self, kind: str, reason: str, records: list[CallRecord]) -> None:
        """Set ``records`` aside (counted lost when there is no quarantine file)."""
        if self.quarantine is None:
            self.lose(kind, len(records))
        elif records:
            await asyncio.to_thread(self.quarantine.records, kind, reason, records)
        self._landed_or_lost(records)

    async def _run(self) -> None:
        if not self._inherited.is_set():  # what earlier processes left: before anything else
            for orphan in list(self._orphans):
                await self._replay_spool(orphan)
                await asyncio.to_thread(orphan.discard)
                self._orphans.remove(orphan)
            await self._replay_spool(self._spool)
            self._inherited.set()
            self._landed.set()
        self._mark_idle()
        while True:
            batch = await self._next_batch()
            rest = await self._write(batch)
            self._settle(len(batch) - len(rest))
            self._inflight = rest
            if rest and not await self._spill(rest):
                await self._wait_before_retry()
            self._inflight = []
            if rest:
                await self._replay_spool(self._spool)
            self._mark_idle()

    async def _write(self, batch: Sequence[CallRecord]) -> list[CallRecord]:
        """Write ``batch``: the records left unwritten because the database is unreachable
        (the others are written, or quarantined when it rejects them)."""
        fault = await self._attempt(batch)
        if fault is None:
            return []
        if not record_fault(fault):
            return list(batch)
        log.error("trace batch rejected (%s); writing rows one by one", fault)
        for i, rec in enumerate(batch):  # the culprits are quarantined, the rest written
            fault = await self._attempt([rec])
            if fault is None:
                continue
            if not record_fault(fault):
                return list(batch[i:])
            self.rejected += 1
            await self._quarantine("rejected", f"{type(fault).__name__}: {fault}", [rec])
        return []

    async def _attempt(self, batch: Sequence[CallRecord]) -> Exception | None:
        """One insert of ``batch``; the exception it raised, if any. Its routed experts
        go to disk while its rows are written, and the rows commit only once they are
        there: a stored row never points at bytes a crash could lose."""
        placed = await self.routes.place(batch) if self.routes is not None else None
        try:
            async with self._sessionmaker() as session, session.begin():
                await write_batch(session, batch)
                if placed is not None:
                    await asyncio.shield(placed.write)
        except Exception as exc:
            if placed is not None and not await placed.landed():
                return await self._attempt(batch)  # rolled back: again, without them
            if not record_fault(exc):
                self.write_errors += 1
                self.db_ok = False
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                log.warning("trace write failed: %s", self.last_error)
            return exc
        self.db_ok = True
        self.written += len(batch)
        self.last_flush_at = time.time()
        self._backoff = self._settings.retry_backoff_s
        self._landed_or_lost(batch)
        return None

    async def _spill(self, records: list[CallRecord], *, final: bool = False) -> bool:
        """Move ``records`` to the spool; what it cannot take stays in memory, retried
        before the queue (``final``, at a stop: is counted lost). True if all moved."""
        refused: list[CallRecord] = records
        error: str | None = "no spool"
        if self._spool is not None:
            out = await asyncio.to_thread(self._spool.append, records)
            self.spooled += out.kept
            refused, error = out.refused, out.error
            self._settle(len(records) - len(refused))
            self._landed_or_lost(out.quarantined)
        self.spool_error = error if refused else None
        if not refused:
            return True
        if final:
            self._settle(len(refused))
            self._landed_or_lost(refused)
            self.lose("stopped", len(refused))
            return False
        if self._spool is not None and self._spool_log.ready(time.monotonic()):
            log.error("the spool refused %d records (%s); holding them in memory (%d held, "
                      "at most %d)", len(refused), error, len(self._held) + len(refused),
                      self._overflow_max)
        self._held.extendleft(reversed(refused))
        return False

    async def _spill_queued(self) -> None:
        """Move what waits in memory to the spool, holding it in ``_inflight`` meanwhile
        (still counted in memory, and spooled by a stop that cancels this)."""
        self._inflight = self._take_queued()
        if self._inflight:
            await self._spill(self._inflight)
        self._inflight = []

    async def _wait_before_retry(self) -> None:
        await asyncio.sleep(self._backoff)
        self._backoff = min(self._backoff * 2, self._settings.retry_backoff_max_s)

    async def _replay_spool(self, spool: Spool | None) -> None:
        """Write ``spool`` back in order, spilling the queue while the DB stays down."""
        backoff = self._settings.retry_backoff_s
        if spool is None:
            return
        while spool.pending_bytes:
            records, position = await asyncio.to_thread(spool.read, self._settings.batch_size)
            self._replaying = (spool, records, position)
            rest = await self._write(records)
            self._replaying = None
            if not rest:
                await asyncio.to_thread(spool.commit, position)
                backoff = self._settings.retry_backoff_s
                if self._queue.qsize() * 2 >= self._queue.maxsize:
                    # calls keep coming while the backlog replays: queue them behind it
                    # (order kept) rather than let the memory queue overflow
                    await self._spill_queued()
                continue
            await self._spill_queued()
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
            await self._spill_queued()
