"""Slowing a simulated pool's clock when its host cannot keep up.

The demo runs the gateway, a managed pool of simulated servers and the agents in one
process. When that process falls behind its compressed clock, each server's engine lets
simulated time slip (``SimEngine.lag_s``) and the run measures the host instead of the
pool. The :class:`Governor` watches the servers' lag and the event loop's thread: when
the servers lose more than ``tolerance`` of the simulated time that passed *and* the
thread was busy nearly all the window (the load outgrew the host; lag with an idle
thread is a stall that a slower clock would not have avoided), it lowers the shared
clock's speed to the pace the host kept (less a margin, at most halving it), and tells
the gateway, whose policies convert wall seconds with it. After a change it waits
``settle`` windows, as the work queued at the old pace drains first. The clock is never
sped up again: a run ends at the pace its busiest stretch allowed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backends.sim.clock import WallClock


@dataclass(slots=True)
class Governor:
    clock: WallClock  # its servers report their lag to it (``WallClock.behind``)
    #: told every new speed (the gateway's ``Scheduler.set_time_scale``)
    on_speed: Callable[[float], None] = lambda _speed: None
    window_s: float = 1.0  # wall seconds between looks
    #: lag tolerated in a window, as a share of the simulated time that passed: a busy
    #: event loop stalls now and then (a garbage collection, a large response) at any
    #: speed, and slowing down cannot remove what does not come from the load
    tolerance: float = 0.03
    saturated: float = 0.9  # the loop's thread busy this share of a window: overloaded
    margin: float = 0.9  # the new speed: the pace the host kept, times this
    settle: int = 3  # windows left alone after a change
    floor: float = 1.0  # never slower than real time
    initial_speed: float = field(init=False)
    behind_s: float = field(init=False, default=0.0)  # simulated seconds lost, all windows
    _settling: int = field(init=False, default=0)
    changes: list[tuple[float, float]] = field(init=False, default_factory=list)  # (sim t, speed)

    def __post_init__(self) -> None:
        self.initial_speed = self.clock.speed

    def observe(self, before: dict[Any, float], after: dict[Any, float], sim_s: float,
                busy: float) -> None:
        """One window: ``sim_s`` simulated seconds passed, the servers' lags went from
        ``before`` to ``after`` (a server seen for the first time counts from its own),
        and the event loop's thread was on the CPU ``busy`` of the window's wall time."""
        lost = max((lag - before.get(url, lag) for url, lag in after.items()), default=0.0)
        self.behind_s += max(0.0, lost)
        if self._settling:
            self._settling -= 1
            return
        if sim_s <= 0 or lost <= self.tolerance * sim_s or busy < self.saturated:
            return
        kept = max(0.5, 1.0 - lost / sim_s)  # the share of the clock's pace the host kept
        speed = max(self.floor, self.clock.speed * kept * self.margin)
        if speed < self.clock.speed:
            self.clock.slow_to(speed)
            self.changes.append((self.clock.now(), speed))
            self._settling = self.settle
            self.on_speed(speed)

    async def run(self) -> None:
        """Look every ``window_s`` until cancelled."""
        before, t0 = dict(self.clock.behind), self.clock.now()
        cpu0, wall0 = time.thread_time(), time.monotonic()
        while True:
            await asyncio.sleep(self.window_s)
            after, t1 = dict(self.clock.behind), self.clock.now()
            cpu1, wall1 = time.thread_time(), time.monotonic()
            self.observe(before, after, t1 - t0, (cpu1 - cpu0) / max(wall1 - wall0, 1e-9))
            before, t0, cpu0, wall0 = after, t1, cpu1, wall1

    def describe(self) -> str:
        if not self.changes:
            return f"clock kept at {self.initial_speed:g}x"
        steps = ", ".join(f"{speed:.1f}x at {t:.0f} s" for t, speed in self.changes)
        return f"clock slowed from {self.initial_speed:g}x as the host fell behind: {steps}"
