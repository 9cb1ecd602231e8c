"""Trajectories a harness left unfinished are forgotten after an idle time.

A harness that dies, times out or is cancelled never calls its trajectory again, and the
trainer may never finish it. Without an end the tracker would hold its token state until
its 100,000-trajectory cap, and the policies would count it as running for ever: the
default policy closes a step (and re-lays out the pool) only once no trajectory of the
step runs, so one abandoned trajectory stopped it for good.

:class:`Expiry` forgets every unfinished trajectory with no call queued or running and no
call for ``trajectories.idle_expire_s`` (:meth:`Tracker.expire
<gateway.trajectories.tracker.Tracker.expire>`): it leaves the tracker, and with it the
policies' snapshot, which is how a policy learns of it (it reads no clock). Nothing
recorded is lost: the store holds its calls, and a later call of the id restores it as
after a restart (:mod:`gateway.trajectories.restore`), so a harness whose tool ran longer
than the idle time goes on where it was, at the cost of one store lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.config import TrajectorySettings
from gateway.loops import Periodic
from gateway.trajectories.tracker import Tracker

log = logging.getLogger(__name__)
#: how often the tracker is looked at, at most: an idle trajectory is forgotten between
#: ``idle_expire_s`` and that plus this (or a quarter of it, if shorter)
CHECK_EVERY_S = 60.0


class Expiry:
    """Forgets idle unfinished trajectories every little while (see the module doc);
    ``clock`` is wall time, as the tracker's timestamps are."""

    def __init__(self, tracker: Tracker, settings: TrajectorySettings, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.tracker = tracker
        self.idle_s = settings.idle_expire_s
        self.clock = clock
        self.expired = 0
        self.loop = Periodic("trajectory-expiry", self._step,
                             min(CHECK_EVERY_S, self.idle_s / 4), logger=log)

    def start(self) -> None:
        self.loop.start()

    async def close(self) -> None:
        await self.loop.close()

    def expire(self) -> list[str]:
        """One look: forget the trajectories idle for ``idle_s``; their ids."""
        gone = self.tracker.expire(self.clock() - self.idle_s)
        if gone:
            self.expired += len(gone)
            log.info("forgot %d trajectories idle for %g s (a later call restores one from "
                     "the store): %s", len(gone), self.idle_s, ", ".join(gone[:5])
                     + (", ..." if len(gone) > 5 else ""))
        return gone

    async def _step(self) -> None:
        self.expire()
