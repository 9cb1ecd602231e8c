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
    """Real time scaled by ``speed``: sim seconds = real seconds * speed.

    :meth:`slow_to` lowers the speed while the clock runs (simulated time stays
    continuous), which is how a process that cannot keep up with its simulation slows it
    down instead of falling behind (``bench.harness.governor``). A sleeper woken early by
    a lower speed sleeps the rest; the speed is never raised, so none wakes late.
    """

    def __init__(self, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = speed
        self._origin = time.monotonic()
        self._base = 0.0  # simulated seconds at _origin
        #: simulated seconds each engine on this clock lost because its process could not
        #: keep up (``SimEngine.lag_s``), by the engine's id: what a governor reads
        self.behind: dict[int, float] = {}

    def now(self) -> float:
        return self._base + (time.monotonic() - self._origin) * self.speed

    def fell_behind(self, who: object, dt: float) -> None:
        self.behind[id(who)] = self.behind.get(id(who), 0.0) + dt

    def slow_to(self, speed: float) -> None:
        if not 0 < speed <= self.speed:
            raise ValueError(f"a clock at {self.speed:g}x can only slow down, not to {speed:g}x")
        self._base, self._origin, self.speed = self.now(), time.monotonic(), speed

    async def sleep(self, dt: float) -> None:
        speed, target = self.speed, self.now() + max(0.0, dt)
        await asyncio.sleep(max(0.0, dt) / speed)
        while self.speed < speed and (left := target - self.now()) > 0:  # slowed meanwhile
            speed = self.speed
            await asyncio.sleep(left / speed)


_SHARED: dict[str, WallClock] = {}


def shared_clock(name: str, speed: float) -> WallClock:
    """The process-wide clock ``name``, made at ``speed`` on first use: the simulated
    servers that name it run on one timeline, which the process may slow
    (:meth:`WallClock.slow_to`) when it falls behind."""
    clock = _SHARED.get(name)
    if clock is None:
        clock = _SHARED[name] = WallClock(speed)
    return clock


def release_clock(name: str) -> None:
    """Forget the shared clock ``name`` (servers still on it keep it)."""
    _SHARED.pop(name, None)


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
