"""One bad entry never stops the queue: faults fail their own call, a watchdog sees stalls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from gateway.errors import SchedulingFailed, TrajectoryFinished
from gateway.policies.base import Dispatch, PendingCall, Snapshot
from tests.gateway.test_scheduler import MODEL, _call, _scheduler


class Poisoned:
    """Wraps a real policy; raises whenever a batch holds a call of the ``bad`` trajectory
    (the shape of the KeyError that once stopped every pass)."""

    def __init__(self, inner: object, bad: str) -> None:
        self._inner, self.bad = inner, bad

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        if any(c.trajectory_id == self.bad for c in pending):
            raise KeyError(self.bad)
        return self._inner.schedule(snap, pending)  # type: ignore[attr-defined, no-any-return]


class Idle:
    """A policy that never dispatches anything (a stuck planner, say)."""

    name = "idle"
    plan_interval_s = None

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        return []


async def test_a_call_the_policy_raises_on_fails_alone_and_the_rest_are_placed():
    sched, backends, tracker = _scheduler(n_backends=2, cap=2)
    sched.policy = Poisoned(sched.policy, bad="poison")  # type: ignore[assignment]
    stages: list[str] = []
    sched.on_fault = stages.append
    good = [asyncio.create_task(sched.place(*_call(tracker, f"ok{i}"), MODEL)) for i in range(3)]
    bad = asyncio.create_task(sched.place(*_call(tracker, "poison"), MODEL))
    await asyncio.sleep(0.02)
    with pytest.raises(SchedulingFailed, match="KeyError"):
        await bad
    placed = await asyncio.gather(*good)
    assert len(placed) == 3 and sum(b.in_flight for b in backends) == 3
    assert sched.faults == 1 and stages == ["policy"] and sched.queue_depth == 0
    # the queue keeps working after the fault, batch path included
    more = [asyncio.create_task(sched.place(*_call(tracker, f"later{i}"), MODEL))
            for i in range(1)]
    assert len(await asyncio.gather(*more)) == 1


async def test_isolation_respects_free_slots():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    sched.policy = Poisoned(sched.policy, bad="poison")  # type: ignore[assignment]
    calls = [asyncio.create_task(sched.place(*_call(tracker, f"t{i}"), MODEL)) for i in range(3)]
    bad = asyncio.create_task(sched.place(*_call(tracker, "poison"), MODEL))
    await asyncio.sleep(0.02)
    assert bad.done() and isinstance(bad.exception(), SchedulingFailed)
    assert sum(t.done() for t in calls) == 1 and backends[0].in_flight == 1
    for t in calls:
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


async def test_a_call_whose_trajectory_left_the_live_set_fails_clearly():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    busy = await sched.place(*_call(tracker, "a"), MODEL)
    waiting = asyncio.create_task(sched.place(*_call(tracker, "gone"), MODEL))
    await asyncio.sleep(0.01)
    tracker.live.pop("gone")  # evicted or otherwise lost while queued
    busy[0].in_flight -= 1
    sched.kick()
    with pytest.raises(SchedulingFailed, match="no longer live"):
        await waiting
    assert sched.faults == 1 and backends[0].in_flight == 0


async def test_finishing_a_trajectory_fails_its_queued_calls_with_409():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    await sched.place(*_call(tracker, "a"), MODEL)
    queued = asyncio.create_task(sched.place(*_call(tracker, "b"), MODEL))
    other = asyncio.create_task(sched.place(*_call(tracker, "c"), MODEL))
    await asyncio.sleep(0.01)
    state = tracker.get("b")
    assert state is not None
    tracker.finish("b", 1.0, time.time())
    sched.trajectory_finished(state)
    with pytest.raises(TrajectoryFinished):
        await queued
    assert not other.done() and sched.faults == 0
    backends[0].in_flight -= 1
    sched.kick()
    await asyncio.wait_for(other, 1)


async def test_watchdog_reports_a_queue_stuck_beside_free_slots_once():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1, watchdog_s=0.05)
    sched.policy = Idle()  # type: ignore[assignment]
    stages: list[str] = []
    sched.on_fault = stages.append
    stuck = asyncio.create_task(sched.place(*_call(tracker, "s"), MODEL))
    await asyncio.sleep(0.01)
    assert not sched.watch()  # not yet: under watchdog_s
    await asyncio.sleep(0.06)
    assert sched.watch() and sched.watch()  # stalled, reported once
    assert sched.stalls == 1 and stages == ["stall"] and sched.stalled_for_s > 0.05
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)
    assert not sched.watch() and sched.stalled_for_s == 0


async def test_watchdog_is_quiet_when_the_pool_is_simply_full():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1, watchdog_s=0.01)
    await sched.place(*_call(tracker, "a"), MODEL)
    waiting = asyncio.create_task(sched.place(*_call(tracker, "b"), MODEL))
    await asyncio.sleep(0.05)
    assert not sched.watch() and sched.stalls == 0
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
