"""Unfinished trajectories left idle are forgotten (gateway/trajectories/expiry.py): the
rule on a real tracker with a fake clock, and the background loop that applies it.
That a forgotten trajectory's next call goes on where it was is
tests/reliability/test_expiry.py."""

from __future__ import annotations

import asyncio
import time

from gateway.config import TrajectorySettings
from gateway.trajectories.expiry import Expiry
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tracker import Tracker


def _call(tracker: Tracker, tid: str, start: float, end: float | None) -> TrajectoryState:
    """One call of ``tid`` from ``start``, over at ``end`` (None: still running)."""
    state = tracker.touch(tid, "g", start)
    tracker.call_arrived(state, [], start)
    tracker.call_dispatched(state, "b0", 0.0)
    if end is not None:
        tracker.call_finished(state, now=end, llm_s=end - start, prompt=[1, 2],
                              completion=[3, 4], ok=True)
    return state


def test_only_trajectories_idle_for_the_whole_time_are_forgotten() -> None:
    tracker = Tracker()
    now = [0.0]
    _call(tracker, "abandoned", 900.0, 1000.0)  # its harness died after this call
    _call(tracker, "generating", 100.0, None)  # one long call, still running
    queued = tracker.touch("queued", "g", 100.0)  # a call waiting for a slot
    tracker.call_arrived(queued, [], 100.0)
    tracker.touch("new", "g", 1100.0)  # seen, no call yet (as a restore leaves it)
    _call(tracker, "recent", 1400.0, 1500.0)
    _call(tracker, "done", 100.0, 200.0)
    tracker.finish("done", 1.0, 300.0)
    expiry = Expiry(tracker, TrajectorySettings(idle_expire_s=600.0), clock=lambda: now[0])
    group_before = list(tracker.groups["g"].members)

    now[0] = 1599.0  # 599 s idle: not yet
    assert expiry.expire() == [] and len(tracker) == 6
    now[0] = 1601.0
    assert expiry.expire() == ["abandoned"]
    assert tracker.get("abandoned") is None and "abandoned" not in tracker.live
    assert len(tracker) == 5 and expiry.expired == 1  # its memory went with it
    assert tracker.groups["g"].members == [m for m in group_before if m != "abandoned"]
    now[0] = 1701.0  # created at 1100 and never called since
    assert expiry.expire() == ["new"]
    now[0] = 1e9  # running and queued calls keep theirs however long; finished ones are
    assert expiry.expire() == ["recent"]  # retired, not live
    assert sorted(tracker.live) == ["generating", "queued"]
    assert tracker.get("done") is not None


async def test_the_loop_forgets_them_in_the_background() -> None:
    tracker = Tracker()
    now = time.time()
    _call(tracker, "abandoned", now - 0.1, now)
    expiry = Expiry(tracker, TrajectorySettings(idle_expire_s=0.2))
    assert expiry.loop.interval_s == 0.05  # a quarter of the idle time, when short
    expiry.start()
    try:
        for _ in range(100):
            if tracker.get("abandoned") is None:
                break
            await asyncio.sleep(0.02)
        assert tracker.get("abandoned") is None and len(tracker) == 0
        assert expiry.expired == 1 and expiry.loop.failures == 0
    finally:
        await expiry.close()
    assert Expiry(tracker, TrajectorySettings()).loop.interval_s == 60.0  # default 1800 s
