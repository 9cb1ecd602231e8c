"""The pure scheduling step both drivers run: plain data in, decisions out, no clock."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.dispatch.step import POLICY, STALE, Queued, schedule_pass
from gateway.policies.base import (
    Dispatch,
    GroupView,
    InstanceState,
    InstanceView,
    PendingCall,
    Snapshot,
    TrajectoryView,
)
from gateway.policies.registry import get_policy


class Fifo:
    """Places calls in arrival order on the instance with most free slots; records what
    it was asked, and raises on calls of the ``bad`` trajectory (in any batch)."""

    name = "fifo"
    plan_interval_s = None

    def __init__(self, bad: str | None = None) -> None:
        self.bad = bad
        self.asked: list[tuple[list[str], dict[str, int]]] = []

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        self.asked.append(([c.key for c in pending], {i.id: i.running for i in snap.instances}))
        if any(c.trajectory_id == self.bad for c in pending):
            raise KeyError(self.bad)
        free = {i.id: i.free_slots for i in snap.instances}
        out = []
        for c in sorted(pending, key=lambda c: c.enqueued_at):
            best = max(free, key=lambda i: (free[i], i))
            if free[best] <= 0:
                break
            free[best] -= 1
            out.append(Dispatch(c.key, best, 7))
        return out


def _snap(*running: int, cap: int = 2, now: float = 100.0) -> Snapshot:
    insts = tuple(InstanceView(f"b{i}", 1, 1, InstanceState.UP, r, cap)
                  for i, r in enumerate(running))
    return Snapshot(now, len(insts), insts, {}, {}, {})


def _q(tid: str, t: float = 0.0, exclude: Sequence[str] = ()) -> Queued:
    return Queued(PendingCall(f"{tid}#0", tid, 0, 10, t), frozenset(exclude))


def test_a_retry_goes_to_the_least_loaded_backend_it_has_not_tried():
    policy = Fifo()
    done = schedule_pass(policy, _snap(0, 1, 0, cap=4), [_q("r", exclude=["b0"])], {"r"})
    assert [(d.key, d.instance, d.priority) for d in done.placed] == [("r#0", "b2", 0)]
    assert policy.asked == [] and done.failed == []  # the policy never sees a retry
    # only tried backends have room: it waits for a later pass
    done = schedule_pass(policy, _snap(0, 2, 2), [_q("r", exclude=["b0"])], {"r"})
    assert done.placed == [] and done.failed == []


def test_the_policy_sees_the_retries_placed_in_the_same_pass():
    policy = Fifo()
    queue = [_q("r", exclude=["b1"]), _q("a", 1.0), _q("b", 2.0)]
    done = schedule_pass(policy, _snap(1, 0, cap=2), queue, {"r", "a", "b"})
    assert policy.asked == [(["a#0", "b#0"], {"b0": 2, "b1": 0})]
    assert [(d.key, d.instance) for d in done.placed] == [("r#0", "b0"), ("a#0", "b1"),
                                                          ("b#0", "b1")]


def test_a_call_whose_trajectory_is_not_live_fails_as_stale():
    policy = Fifo()
    done = schedule_pass(policy, _snap(0), [_q("gone"), _q("here", 1.0)], {"here"})
    assert [(f.call.trajectory_id, f.reason, f.error) for f in done.failed] == [
        ("gone", STALE, None)]
    assert [d.key for d in done.placed] == ["here#0"]
    assert policy.asked[0][0] == ["here#0"]


def test_a_policy_raising_on_one_call_fails_only_that_call():
    policy = Fifo(bad="poison")
    queue = [_q("a", 1.0), _q("poison", 2.0), _q("b", 3.0)]
    done = schedule_pass(policy, _snap(0, 0), queue, {"a", "poison", "b"})
    assert [(f.call.key, f.reason, type(f.error)) for f in done.failed] == [
        ("poison#0", POLICY, KeyError)]
    assert sorted(d.key for d in done.placed) == ["a#0", "b#0"] and done.isolated


def test_the_cap_holds_whatever_the_policy_answers():
    class Greedy(Fifo):
        def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
            return [Dispatch(c.key, "b0", 0) for c in pending] + [Dispatch("x", "b0", 0),
                                                                Dispatch("a#0", "nowhere", 0)]

    queue = [_q("a"), _q("b", 1.0), _q("c", 2.0)]
    done = schedule_pass(Greedy(), _snap(1, cap=3), queue, {"a", "b", "c"})
    assert [d.key for d in done.placed] == ["a#0", "b#0"]  # two free slots on b0


def test_with_no_free_slot_the_policy_is_not_asked_but_stale_calls_still_fail():
    policy = Fifo()
    done = schedule_pass(policy, _snap(2, 2), [_q("a"), _q("gone")], {"a"})
    assert policy.asked == [] and done.placed == []
    assert [f.call.trajectory_id for f in done.failed] == ["gone"]


def test_an_unchanged_pass_reports_no_change_and_asks_nothing():
    policy = Fifo()
    snap, queue = _snap(2, 1), [_q("a"), _q("b", 1.0)]
    first = schedule_pass(policy, snap, queue, {"a", "b"}, revision=3)
    assert first.changed and [d.key for d in first.placed] == ["a#0"]
    # the driver placed nothing (say the call was cancelled before): same inputs again
    again = schedule_pass(policy, snap, queue, {"a", "b"}, revision=3, last=first.key)
    assert not again.changed and again.placed == [] and len(policy.asked) == 1
    # a change the step cannot see (a trajectory moved) comes as a new revision
    bumped = schedule_pass(policy, snap, queue, {"a", "b"}, revision=4, last=first.key)
    assert bumped.changed and len(policy.asked) == 2
    # a slot freeing up is a change the step sees itself
    freed = schedule_pass(policy, _snap(1, 1), queue, {"a", "b"}, revision=3, last=first.key)
    assert freed.changed and len(freed.placed) == 2


def test_a_shipped_policy_runs_through_the_step_on_plain_data():
    views = {t: TrajectoryView(t, "g", "p", 0.0, 0, 10, 0) for t in ("a", "b")}
    snap = replace(_snap(0, 0), trajectories=views, groups={"g": GroupView("g", ("a", "b"))})
    done = schedule_pass(get_policy("slime"), snap, [_q("a"), _q("b", 1.0)], views)
    assert sorted(d.key for d in done.placed) == ["a#0", "b#0"] and done.failed == []
