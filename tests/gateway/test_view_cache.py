"""The policies' cached views never go stale: after any run of the tracker's operations,
the view a policy reads equals one built from the state right then.

The tracker's methods that change what a view shows drop it (``_changes_view`` and the
group's own methods); a field written around them is what this check catches (the last
test plants one)."""

from __future__ import annotations

import random

import pytest

from gateway.dispatch.views import group_view, trajectory_view
from gateway.policies.base import GroupView, TrajectoryView
from gateway.trajectories.state import GroupState, TrajectoryState
from gateway.trajectories.tools import ToolOutcome
from gateway.trajectories.tracker import Tracker


def _fresh(st: TrajectoryState) -> TrajectoryView:
    cached, st.view = st.view, None
    try:
        return trajectory_view(st)
    finally:
        st.view = cached


def _fresh_group(group_id: str, g: GroupState) -> GroupView:
    cached, g.view = g.view, None
    try:
        return group_view(group_id, g)
    finally:
        g.view = cached


def _check(tracker: Tracker) -> None:
    for st in tracker:
        assert trajectory_view(st) == _fresh(st), st.id
    for gid, g in tracker.groups.items():
        assert group_view(gid, g) == _fresh_group(gid, g), gid


def _step(tracker: Tracker, rng: random.Random, now: float) -> None:
    tid = f"t{rng.randrange(6)}"
    state = tracker.get(tid)
    op = rng.randrange(9)
    if state is None or op == 0:
        state = tracker.touch(tid, rng.choice([None, f"g{rng.randrange(2)}"]), now)
        if state.prompt_id is None:
            tracker.describe(state, prompt_id=f"p{tid}", model="m", auto=False)
    elif op == 1:
        tracker.call_arrived(state, [ToolOutcome("search", 10, "small", "ok")] * rng.randrange(2),
                             now)
    elif op == 2 and state.queued:
        tracker.call_dispatched(state, f"b{rng.randrange(3)}", rng.random())
    elif op == 3 and state.in_flight:
        tracker.call_requeued(state)
    elif op == 4 and state.queued:
        tracker.call_abandoned(state)
    elif op == 5 and state.in_flight:
        prompt = [*state.sequence, 1, 2]
        tracker.call_finished(state, now=now, llm_s=rng.random(), prompt=prompt,
                              completion=[3] * rng.randrange(1, 5), ok=rng.random() < 0.9)
    elif op == 6:
        tracker.prefer(state, f"b{rng.randrange(3)}")
    elif op == 7 and not state.in_flight and not state.queued:
        tracker.finish(tid, rng.choice([None, 1.0]), now)
    elif op == 8:
        tracker.expire(now - 5)


@pytest.mark.parametrize("seed", range(20))
def test_a_policy_never_reads_a_stale_view(seed: int) -> None:
    rng = random.Random(seed)
    tracker = Tracker(capacity=5, retain_retired=3)
    for k in range(400):
        _step(tracker, rng, now=1000.0 + k)
        if rng.random() < 0.7:  # read views between some operations, as the scheduler does
            _check(tracker)
    _check(tracker)


def test_a_field_written_around_the_tracker_is_caught() -> None:
    tracker = Tracker()
    state = tracker.touch("t", "g", 1.0)
    tracker.call_arrived(state, [], 1.0)
    trajectory_view(state)
    state.queued -= 1  # not through call_abandoned: the cached view still says queued
    with pytest.raises(AssertionError):
        _check(tracker)
