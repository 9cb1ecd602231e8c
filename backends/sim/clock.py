"""Clocks for the simulated engine: wall time (optionally compressed) or virtual time.

The HTTP server runs on a :class:`WallClock` whose ``speed`` compresses simulated time
(``speed=20``: a 20 s rollout takes 1 s of real time), so demos and integration tests
see realistic *relative* latencies quickly. The discrete-event simulator drives engines
on a :class:`VirtualClock` that only moves when told to, so thousands of engine steps
cost no real waiting at all.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Simulated time in seconds."""

    def now(self) -> float: ...

    async def sleep(self, dt: float) -> None:
        """Wait ``dt`` simulated seconds."""
        ...


class WallClock:
    """Real time scaled by ``speed``: sim seconds = real seconds * speed."""

    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.speed

    async def sleep(self, dt: float) -> None:
        await asyncio.sleep(max(0.0, dt) / self.speed)


class VirtualClock:
    """Time that only moves through :meth:`advance` / :meth:`advance_to`.

    ``sleep`` advances the clock instead of waiting, which is what a single coroutine
    driving a simulation wants; a discrete-event loop should call ``advance_to`` itself.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"cannot move a clock backwards (dt={dt})")
        self._now += dt

    def advance_to(self, t: float) -> None:
        """Move to ``t`` (no-op if ``t`` is in the past)."""
        self._now = max(self._now, t)

    async def sleep(self, dt: float) -> None:
        self.advance(max(0.0, dt))
