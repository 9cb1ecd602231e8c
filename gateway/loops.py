"""The one base of the gateway's periodic background work.

A :class:`Periodic` runs a step coroutine every ``interval_s`` seconds in its own task,
from ``start()`` until ``close()``. Its guarantees, so no loop repeats them:

- A step that raises is logged (with its traceback, at most once per ``error_every_s``,
  counting the failures in between) and the loop goes on with the next step.
- A step that takes longer than the interval is logged as an overrun (at most once per
  ``error_every_s``); the next step then starts at once, with no burst to catch up.
- The loop never ends silently: only ``close()`` stops it; if its task ends any other way
  (a ``BaseException`` out of a step), that is logged as an error.

Steps start ``interval_s`` apart (start to start), the first one an interval after
``start()`` unless ``immediately``. After Prefect's ``LoopService``
(``src/prefect/server/services/loop_service.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

#: how often a failing or overrunning loop logs, at most (the first time always)
ERROR_EVERY_S = 60.0


class RateLimit:
    """Whether to log now: the first time, then at most once per ``every_s``; counts the
    occurrences it held back so the next line can say how many there were."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.held = 0
        self._last: float | None = None

    def ready(self, now: float) -> bool:
        if self._last is not None and now - self._last < self.every_s:
            self.held += 1
            return False
        self._last = now
        return True

    def take_held(self) -> int:
        held, self.held = self.held, 0
        return held


class Periodic:
    """``step`` every ``interval_s`` seconds in a background task; see the module doc."""

    def __init__(
        self,
        name: str,
        step: Callable[[], Awaitable[None]],
        interval_s: float,
        *,
        immediately: bool = False,
        error_every_s: float = ERROR_EVERY_S,
        logger: logging.Logger | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"{name}: interval_s must be positive, not {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self.steps = 0
        self.failures = 0
        self.overruns = 0
        self._step = step
        self._immediately = immediately
        self._log = logger or log
        self._errors = RateLimit(error_every_s)
        self._overrun_log = RateLimit(error_every_s)
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"{self.name}: already started")
        self._task = asyncio.create_task(self._run(), name=self.name)
        report_unexpected_end(self._task, self._log, lambda: self._closing)

    async def close(self) -> None:
        """Stop the loop, cancelling a step under way; returns once it has stopped."""
        self._closing = True
        if self._task is None or self._task.done():  # an end by other means is logged
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        if not self._immediately:
            await asyncio.sleep(self.interval_s)
        while True:
            started = time.monotonic()
            await self._once()
            took = time.monotonic() - started
            if took > self.interval_s:
                self._overran(took)
            await asyncio.sleep(max(0.0, self.interval_s - took))

    async def _once(self) -> None:
        try:
            await self._step()
        except Exception:  # logged; the next step runs as usual
            self.failures += 1
            if self._errors.ready(time.monotonic()):
                held = self._errors.take_held()
                more = f" ({held} more failures since the last report)" if held else ""
                self._log.exception("%s: a step failed%s; the loop goes on", self.name, more)
        finally:
            self.steps += 1

    def _overran(self, took: float) -> None:
        self.overruns += 1
        if self._overrun_log.ready(time.monotonic()):
            held = self._overrun_log.take_held()
            more = f" ({held} more overruns since the last report)" if held else ""
            self._log.warning("%s: a step took %.3g s, longer than its %.3g s interval%s",
                              self.name, took, self.interval_s, more)


def report_unexpected_end(task: asyncio.Task[None], logger: logging.Logger,
                          closing: Callable[[], bool]) -> None:
    """Log an error (with the traceback) if ``task``, a background task meant to run until
    its owner stops it, ends while ``closing()`` is false. For loops that are not periodic
    (the trace writer) as much as for :class:`Periodic`."""

    def ended(done: asyncio.Task[None]) -> None:
        if closing():
            return
        exc = None if done.cancelled() else done.exception()
        how = "cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
        logger.error("%s: the loop stopped without close() (%s)", done.get_name(), how,
                     exc_info=exc)

    task.add_done_callback(ended)
