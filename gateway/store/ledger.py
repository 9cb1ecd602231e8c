"""The trace writer's ledger: what it accepted and what became of each record.

A base of :class:`gateway.store.writer.TraceWriter`, apart so that the writer's module
holds its mechanism only. Every accepted record ends *settled* exactly one way: written,
spooled (to be written later), quarantined (:mod:`gateway.store.quarantine`) or lost;
``lost`` counts the last by reason, and is never silent (logged, ``/status``,
``/metrics``). Readers wait on the ledger: :meth:`WriterLedger.drain` for everything
submitted so far, :meth:`WriterLedger.stored` for one trajectory's records (the restore
after a restart must not read the store before they are in it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence

from gateway.loops import ERROR_EVERY_S, RateLimit
from gateway.store.records import CallRecord

log = logging.getLogger("gateway.store.writer")

#: why a record can be lost (each a label of ``rollout_gateway_trace_lost_total``)
LOSS_REASONS = ("memory_full", "stopped", "rejected", "writer_failure")


class WriterLedger:
    """Counters, state and the waits on them; the writer calls the underscored methods."""

    def __init__(self) -> None:
        self.written = 0
        self.rejected = 0  # by the database (then quarantined)
        self.spooled = 0
        self.write_errors = 0
        self.lost: Counter[str] = Counter()
        self.db_ok = True
        self.last_error: str | None = None
        self.last_flush_at: float | None = None
        self.running = True  # False between a failure of the loop and its restart
        self.restarts = 0
        self.failure: str | None = None  # the last failure of the loop
        self.spool_error: str | None = None  # why the spool refused records, while it does
        self._lost_log = RateLimit(ERROR_EVERY_S)
        # drain's watermark: records accepted so far, and records the writer has settled,
        # counted in the order it takes them; ``_pending`` the difference
        self._accepted = 0
        self._settled = 0
        self._pending = 0
        self._progress = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # for the restore: records accepted and not yet in the database, by trajectory, and
        # whether the spools an earlier process left have been written
        self._unwritten: Counter[str] = Counter()
        self._inherited = asyncio.Event()
        self._landed = asyncio.Event()  # set whenever records reach the database (or are lost)

    @property
    def dropped(self) -> int:
        """Records lost, whatever the reason."""
        return sum(self.lost.values())

    def lose(self, reason: str, n: int) -> None:
        """Count ``n`` records lost for ``reason``, and say so (rate-limited, never silent)."""
        self.lost[reason] += n
        if self._lost_log.ready(time.monotonic()):
            held = self._lost_log.take_held()
            more = f" ({held} more losses since the last report)" if held else ""
            log.error("%d trace records lost (%s)%s; %d lost so far: %s", n, reason, more,
                      self.dropped, dict(self.lost))

    def _backlog(self) -> bool:
        """Records wait outside the queue's order (overflow, held, spool): the writer's."""
        raise NotImplementedError

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
                while not self._idle.is_set() and not (
                        self._settled >= target and not self._backlog()):
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            return False
        return True

    async def stored(self, trajectory_id: str, *, timeout_s: float) -> bool:
        """Wait until the database holds every record of ``trajectory_id`` this writer
        accepted, and the spools an earlier process left behind. False on timeout.

        A record counts once it is written, or out of reach for good (quarantined, or
        lost): nothing is left to wait for then."""
        try:
            async with asyncio.timeout(timeout_s):
                while not self._inherited.is_set() or self._unwritten.get(trajectory_id):
                    self._landed.clear()
                    await self._landed.wait()
        except TimeoutError:
            return False
        return True

    def _accept(self, record: CallRecord) -> None:
        self._unwritten[record.trajectory_id] += 1
        self._pending += 1
        self._accepted += 1
        self._idle.clear()

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

    def _settle(self, n: int) -> None:
        self._pending -= n
        self._settled += n
        self._progress.set()

    def _mark_idle(self) -> None:
        if self._pending == 0 and not self._backlog():
            self._idle.set()
        self._progress.set()
