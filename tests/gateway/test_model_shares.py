"""Models that share a base's engines (the base and its LoRA families) share its free slots
fairly when their calls queue: one trainer's burst does not starve another policy."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from gateway.config import DispatchSettings
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.scheduler import Scheduler
from gateway.dispatch.shares import fair_shares
from gateway.dispatch.speeds import speeds_for
from gateway.policies.base import CallView
from gateway.policies.registry import get_policy
from gateway.trajectories.tracker import Tracker

BASE = "qwen3-8b"


def test_fair_shares_fill_the_least_served_first() -> None:
    assert fair_shares(4, {"a": 10, "b": 10}, {}) == {"a": 2, "b": 2}
    assert fair_shares(4, {"a": 10, "b": 10}, {"a": 4}) == {"a": 0, "b": 4}
    assert fair_shares(4, {"a": 10, "b": 1}, {}) == {"a": 3, "b": 1}  # b wants less
    assert fair_shares(6, {"a": 10, "b": 10}, {}, {"a": 2}) == {"a": 4, "b": 2}
    assert fair_shares(5, {"a": 1, "b": 1}, {}) == {"a": 1, "b": 1}
    assert fair_shares(0, {"a": 3}, {}) == {"a": 0}
    with pytest.raises(ValueError, match="weights must be positive"):
        fair_shares(1, {"a": 1}, {}, {"a": 0})


def test_fair_shares_are_max_min_fair_and_leave_no_slot_idle() -> None:
    rng = random.Random(7)
    for _ in range(500):
        names = [f"m{i}" for i in range(rng.randint(1, 4))]
        waiting = {m: rng.randint(0, 8) for m in names}
        running = {m: rng.randint(0, 8) for m in names}
        weights = {m: rng.choice([0.5, 1.0, 2.0, 3.0]) for m in names}
        free = rng.randint(0, 20)
        got = fair_shares(free, waiting, running, weights)
        assert sum(got.values()) == min(free, sum(waiting.values()))
        assert all(0 <= got[m] <= waiting[m] for m in names)
        for p in names:  # p wants more: none who got a slot was better served than p
            if got[p] < waiting[p]:
                for q in names:
                    if got[q]:
                        assert (running[p] + got[p]) / weights[p] >= \
                            (running[q] + got[q] - 1) / weights[q] - 1e-9


def _pool(cap: int, **kw: object) -> tuple[Dispatcher, Scheduler, Tracker]:
    registry, tracker = BackendRegistry(), Tracker()
    registry.add(Backend("b0", "http://127.0.0.1:9", tp=1, models={BASE}, healthy=True))
    settings = DispatchSettings(cap_per_gpu=cap, **kw)  # type: ignore[arg-type]
    sched = Scheduler(registry, tracker, get_policy("replay"), speeds_for("qwen3-14b/H100"),
                      settings)
    return Dispatcher(registry, sched, settings), sched, tracker


async def _burst(dispatcher: Dispatcher, tracker: Tracker, family: str, n: int
                 ) -> list[asyncio.Task]:
    tasks = []
    for i in range(n):
        st = tracker.touch(f"{family}-{i}", f"g-{family}", time.time())
        view = CallView(st.id, tracker.call_arrived(st, [], time.time()), 100)
        tasks.append(asyncio.create_task(dispatcher.acquire(view, BASE, family=family)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.02)
    return tasks


@pytest.mark.parametrize(("shares", "verifier_gets"), [({}, 2), ({"verifier": 3}, 3)])
async def test_a_burst_of_one_family_does_not_starve_another(
        shares: dict[str, float], verifier_gets: int) -> None:
    """The solver's trainer queues 20 calls on a base with 4 slots, then the verifier's 4
    arrive: as the solver's calls end, the slots go to the verifier until both hold their
    share (2 and 2; 1 and 3 with the verifier weighted 3), not to the solver's older
    calls, which arrived first and which the policy alone would run first."""
    dispatcher, sched, tracker = _pool(cap=4, model_shares=shares)
    solver = await _burst(dispatcher, tracker, "solver", 20)
    running = [t for t in solver if t.done()]
    assert len(running) == 4 and sched.running == {"solver": 4}
    verifier = await _burst(dispatcher, tracker, "verifier", 4)
    assert not any(t.done() for t in verifier)  # no free slot: nothing moves
    for lease_task in running:  # the solver's four calls end, one by one
        lease_task.result().release()
        await asyncio.sleep(0.02)
    assert sum(t.done() for t in verifier) == verifier_gets
    assert sched.running == {"solver": 4 - verifier_gets, "verifier": verifier_gets}
    for t in verifier:  # leases released: the counts go back to nothing
        if t.done():
            t.result().release()
    for t in solver + verifier:
        t.cancel()
    await asyncio.gather(*solver, *verifier, return_exceptions=True)
    for t in solver + verifier:
        if t.done() and not t.cancelled() and t.exception() is None and \
                not t.result().released:
            t.result().release()
    assert sum(sched.running.values()) == 0 and sched.queue_depth == 0


async def test_one_family_alone_takes_every_slot() -> None:
    dispatcher, sched, tracker = _pool(cap=4)
    calls = await _burst(dispatcher, tracker, "solver", 6)
    assert sum(t.done() for t in calls) == 4 and sched.running == {"solver": 4}
    for t in calls:
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    for t in calls:
        if not t.cancelled() and t.exception() is None:
            t.result().release()
    assert not sched.running
