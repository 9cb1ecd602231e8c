"""The straggler lane (``straggler-lane``): lane routing and the per-step layout it learns."""

from __future__ import annotations

from gateway.policies.base import Phase, Prediction, Slots
from gateway.policies.compose import ComposedPolicy
from gateway.policies.lane import LanePlacer, LanePlanner, lane_layout
from gateway.policies.registry import get_policy
from tests.policies.fakes import call, inst, snapshot, traj


def _finish(policy: ComposedPolicy, tid: str, generated: int, now: float) -> None:
    done = traj(tid, generated=generated, phase=Phase.FINISHED)
    policy.observe(done, {}, now)


def test_top_predicted_trajectory_goes_to_the_lane_and_the_bulk_stays_off_it() -> None:
    planner = LanePlanner(k=1)
    placer = LanePlacer(k=1, planner=planner)
    a, b = inst("a-tp8", tp=8, cap=256), inst("b-tp8", tp=8, running=100, cap=256)
    rest = [inst(f"c{i}-tp8", tp=8, running=100, cap=100) for i in range(2)]  # full
    long_, short = traj("long", turns=1), traj("short", turns=1)
    snap = snapshot(0.0, [a, b, *rest], [long_, short])
    placer.refresh(snap, {"long": Prediction(9000, 12000), "short": Prediction(300, 400)})
    assert placer.lane == "a-tp8" and placer.members == {"long"}
    slots = Slots.of(snap)
    # the lane is emptier, but only the predicted straggler may use it
    assert placer.choose(call("long"), long_, None, slots, snap) == "a-tp8"
    assert placer.choose(call("short"), short, None, slots, snap) == "b-tp8"
    assert placer.target_of("long") == "a-tp8" and placer.target_of("short") is None
    # the planner remembers the straggler joined with all of its tokens to go
    assert planner.current.lane_joins == {"long": 0}


def test_small_pool_starts_as_the_best_static_layout_and_larger_pools_split_a_lane() -> None:
    assert lane_layout(8, 8) == (8,)
    assert lane_layout(16, 8) == (8, 8)
    assert lane_layout(12, 2) == (8, 2, 2)


def test_the_lane_is_dropped_when_it_missed_last_steps_straggler() -> None:
    policy = get_policy("straggler-lane")
    assert isinstance(policy, ComposedPolicy)
    planner = policy.planner
    assert isinstance(planner, LanePlanner)
    assert policy.initial_layout(16) == (8, 8) and planner.lane_on  # step 1: try the lane
    planner.joined_lane("early", 0)
    _finish(policy, "early", 500, 10.0)
    _finish(policy, "late", 16000, 90.0)  # finished last, never on the lane
    assert policy.initial_layout(16) == (8, 8) and not planner.lane_on
    assert planner.last is not None and planner.last.last_id == "late"
    # a step where it caught the last finisher early keeps the lane for the next one
    planner.joined_lane("late2", 1000)
    _finish(policy, "late2", 16000, 200.0)
    assert policy.initial_layout(16) == (8, 8) and planner.lane_on


def test_without_the_lane_a_group_is_dealt_round_robin_and_trajectories_stay_home() -> None:
    """Lane off: verl's routing, not sgl-router's cache_aware, which would keep a GRPO
    group on the instance that holds its shared prompt (``docs/benchmarks/history.md``: 3-18% slower
    on static TP8 at 64 GPUs)."""
    planner = LanePlanner(k=8)
    planner.lane_on = False
    placer = LanePlacer(k=8, planner=planner)
    instances = [inst(n, tp=8, cap=256) for n in ("a", "b", "c", "d")]
    group = [traj(f"h-{i}", "heavy", context=4000) for i in range(8)]
    snap = snapshot(0.0, instances, group)
    placer.refresh(snap, {})
    assert placer.lane is None
    slots = Slots.of(snap)
    placed = [placer.choose(call(t.id), t, None, slots, snap) for t in group]
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c", "d", "d"]
    home = traj("h-0", "heavy", turns=3, instance="c")
    assert placer.choose(call("h-0", seq=3), home, None, slots, snap) == "c"


def test_several_lanes_split_the_top_predicted_and_keep_a_member_where_it_sits() -> None:
    placer = LanePlacer(k=1, lanes=2)
    a, b, c = inst("a", tp=8, cap=256), inst("b", tp=8, cap=256), inst("c", tp=8, cap=256)
    full = [inst(f"d{i}", tp=8, running=100, cap=100) for i in range(5)]  # 64 GPUs in all
    first, second, third = traj("x"), traj("y", instance="b"), traj("z")
    snap = snapshot(0.0, [a, b, c, *full], [first, second, third])
    placer.refresh(snap, {"x": Prediction(9000, 0), "y": Prediction(8000, 0),
                          "z": Prediction(100, 0)})
    assert placer.lanes == ("a", "b") and placer.members == {"x", "y"}
    # y already holds its cache on lane b: it stays; x takes the other lane
    assert placer.target_of("y") == "b" and placer.target_of("x") == "a"
    slots = Slots.of(snap)
    assert placer.choose(call("z"), third, None, slots, snap) == "c"  # bulk: off the lanes


def test_no_lane_where_it_would_hold_more_than_a_quarter_of_the_pool() -> None:
    """Two TP8 instances (16 GPUs) or two backends of a static pool: a lane would idle
    half the pool for eight trajectories; from four instances of equal TP it splits."""
    preds = {"long": Prediction(9000, 12000), "short": Prediction(300, 400)}
    trajs = [traj("long"), traj("short")]
    for pool in ([inst("a", tp=8, cap=256), inst("b", tp=8, cap=256)],
                 [inst("a", tp=1), inst("b", tp=1)],
                 [inst("a", tp=8, cap=256)] + [inst(f"b{i}", tp=1) for i in range(16)]):
        placer = LanePlacer(k=1)
        placer.refresh(snapshot(0.0, pool, trajs), preds)
        assert placer.lane is None and placer.members == frozenset()
    placer = LanePlacer(k=1)
    placer.refresh(snapshot(0.0, [inst(n, tp=2) for n in "abcd"], trajs), preds)
    assert placer.lane == "a" and placer.members == {"long"}


def test_a_live_gateway_starts_the_next_step_when_the_batch_is_over() -> None:
    """A live gateway never calls ``initial_layout`` between RL steps: the step ends at
    the first plan that finds every trajectory finished, and the lane switch follows."""
    policy = get_policy("straggler-lane")
    assert isinstance(policy, ComposedPolicy)
    planner = policy.planner
    assert isinstance(planner, LanePlanner) and planner.lane_on
    pool = [inst(n, tp=8, cap=256) for n in "abcd"]
    planner.joined_lane("early", 0)
    _finish(policy, "early", 500, 10.0)
    # one trajectory still in its tool gap: the step goes on
    running = traj("late", generated=9000, phase=Phase.TOOL, instance="b")
    policy.plan(snapshot(20.0, pool, [running]))
    assert planner.last is None and planner.lane_on
    _finish(policy, "late", 16000, 90.0)  # finished last, never on the lane
    done = [traj(t, generated=g, phase=Phase.FINISHED) for t, g in (("early", 500),
                                                                    ("late", 16000))]
    policy.plan(snapshot(92.0, pool, done))
    assert planner.last is not None and planner.last.last_id == "late"
    assert not planner.lane_on  # the lane missed the straggler: the next step runs without
    policy.plan(snapshot(94.0, pool, done))  # nothing new finished: still the same step
    assert planner.last.last_id == "late" and planner.current.trajectories == 0
