"""The scheduler's watchdog: a queue stuck beside free slots is reported, once.

A healthy scheduler dispatches within a pass of a slot freeing up. When calls have waited
``watchdog_s`` with no dispatch although some routable backend is below its cap, the
stall is counted and reported once (the scheduler logs it with what is waiting and forces
another pass); any dispatch, or a queue with nothing it could place, ends it.
"""

from __future__ import annotations

from collections.abc import Callable


class Watchdog:
    def __init__(self, limit_s: float, clock: Callable[[], float]) -> None:
        self.limit_s = limit_s
        self.clock = clock
        self.stalls = 0  # times the queue was found stuck beside free slots
        self.stalled = False
        self.last_progress = clock()

    def progress(self) -> None:
        """A call was dispatched."""
        self.last_progress = self.clock()
        self.stalled = False

    def check(self, now: float, stuck_possible: bool) -> tuple[bool, bool]:
        """``stuck_possible``: calls wait and some backend has a free slot. Returns
        (stalled now, a stall that began with this check)."""
        if not stuck_possible:
            self.last_progress = now
            self.stalled = False
            return False, False
        if now - self.last_progress < self.limit_s:
            return False, False
        began = not self.stalled
        if began:
            self.stalled = True
            self.stalls += 1
        return True, began

    @property
    def stalled_for_s(self) -> float:
        return self.clock() - self.last_progress if self.stalled else 0.0
