"""Heddle, Libra and ours mechanisms with typed fakes and an explicit clock."""

from __future__ import annotations

import pytest

from gateway.policies.base import GroupView, Phase, Prediction, Relayout, Slots, TPSpeed
from gateway.policies.dp import dp_split, presorted_dp, units_of
from gateway.policies.placement import CMLFQPlacer, ProgressivePriority
from gateway.policies.predict import OraclePredictor, StatsPredictor
from gateway.policies.registry import get_policy
from gateway.policies.resources import GainMigrator, JointPlanner, TailMergePlanner
from gateway.policies.tree import CausalTree
from tests.policies.fakes import SPEEDS, call, inst, snapshot, traj


def test_progressive_priority_runs_longest_predicted_first() -> None:
    p = ProgressivePriority()
    short = p.key(call("s"), traj("s"), Prediction(100, 200), now=0.0)
    long = p.key(call("l"), traj("l"), Prediction(9000, 20000), now=0.0)
    assert long < short


def test_aging_bounds_the_wait_of_a_short_call() -> None:
    """Fake clock: a stream of long arrivals never starves a short call."""
    p = ProgressivePriority(aging_tokens_per_s=400.0)
    short = call("short", t=0.0)
    now = 0.0
    while True:
        now += 1.0
        fresh_long = call(f"long{now}", t=now)
        k_short = p.key(short, traj("short"), Prediction(100, 100), now)
        k_long = p.key(fresh_long, traj("long"), Prediction(20000, 20000), now)
        if k_short < k_long:
            break
        assert now < 60.0, "short call starved"
    assert now == pytest.approx((20000 - 100) / 400.0, abs=1.0)


def test_group_statistics_rank_a_heavy_group_above_a_light_one() -> None:
    pred = StatsPredictor()
    heavy = [traj(f"h{i}", "heavy", turns=2, generated=4000) for i in range(4)]
    light = [traj(f"l{i}", "light", turns=2, generated=400) for i in range(4)]
    snap = snapshot(0.0, [inst("a")], heavy + light)
    assert pred.predict(heavy[0], snap).mean > 3 * pred.predict(light[0], snap).mean


def test_finished_siblings_pull_the_prediction() -> None:
    pred = StatsPredictor()
    t = traj("t", "g", turns=3, generated=1000)
    groups = [GroupView("g", ("t", "a", "b"), (20000, 22000), (20, 22))]
    snap = snapshot(0.0, [inst("a")], [t], groups)
    assert pred.predict(t, snap).mean > 10000


def test_causal_tree_uses_the_deepest_prefix_with_samples() -> None:
    tree = CausalTree(min_samples=2)
    for k, total in enumerate((1000, 1200, 9000, 9400)):
        state = "bash:small:timeout" if total > 5000 else "bash:small:success"
        tid = f"t{k}"
        tree.observe(traj(tid, phase=Phase.TOOL, generated=100), {}, 0.0)
        tree.observe(traj(tid, outcomes=(state,), generated=100), {}, 0.0)
        tree.observe(traj(tid, outcomes=(state,), generated=total, phase=Phase.FINISHED,
                          turns=3), {}, 0.0)
    probe_bad = traj("x", outcomes=("bash:small:timeout",), generated=100)
    probe_ok = traj("y", outcomes=("bash:small:success",), generated=100)
    found_bad, found_ok = tree.lookup(probe_bad), tree.lookup(probe_ok)
    assert found_bad is not None and found_ok is not None
    assert found_bad[1] == 2  # matched at depth 1 (+1)
    assert found_bad[0].mean > 5 * found_ok[0].mean


def test_cmlfq_moves_only_when_mean_and_p90_buckets_agree() -> None:
    placer = CMLFQPlacer({1: 4000, 2: 12000, 4: 30000})
    instances = [inst("t1", 1), inst("t2", 2), inst("t4", 4)]
    snap = snapshot(0.0, instances, [traj("x", turns=1)])
    slots = Slots.of(snap)
    # mean says TP2, P90 says TP4: disagree -> stays in the smallest bucket
    assert placer.choose(call("x"), traj("x", turns=1), Prediction(8000, 20000), slots,
                         snap) == "t1"
    # both say TP4 -> skips a level
    assert placer.choose(call("x"), traj("x", turns=2), Prediction(20000, 25000), slots,
                         snap) == "t4"


def test_cmlfq_falls_back_to_the_nearest_bucket_then_anywhere_when_full() -> None:
    """Libra's router: a full bucket does not hold the call; it goes to the nearest
    bucket with room, and when every bucket is full to the least-loaded instance."""
    placer = CMLFQPlacer({1: 4000, 2: 12000, 4: 30000})
    full_t1 = [inst("t1", 1, running=4), inst("t2", 2, running=1), inst("t4", 4, running=3)]
    snap = snapshot(0.0, full_t1, [traj("x")])
    assert placer.choose(call("x"), traj("x"), None, Slots.of(snap), snap) == "t2"
    only_t4 = [inst("t1", 1, running=4), inst("t2", 2, running=4), inst("t4", 4, running=3)]
    snap = snapshot(0.0, only_t4, [traj("y")])
    assert placer.choose(call("y"), traj("y"), None, Slots.of(snap), snap) == "t4"


def test_dp_gives_the_longest_trajectories_the_fastest_instance() -> None:
    speeds = [SPEEDS[4], SPEEDS[1], SPEEDS[1]]
    units = units_of([30000.0, 2000.0, 1500.0, 1000.0, 900.0])
    makespan, ranges = dp_split(units, speeds)
    assert ranges[0] == (0, 1)  # the 30k trajectory alone on TP4
    assert makespan == pytest.approx(30000 * SPEEDS[4].per_token_s)


def test_dp_aggregates_short_trajectories() -> None:
    units = units_of([float(1000 - i) for i in range(500)], max_units=48, singles=24)
    assert len(units) <= 48 and sum(u[1] for u in units) == 500


def test_presorted_dp_maps_every_predicted_trajectory() -> None:
    snap = snapshot(0.0, [inst("a", 4), inst("b"), inst("c")],
                    [traj(f"t{i}") for i in range(6)])
    preds = {f"t{i}": Prediction(1000.0 * (i + 1), 0) for i in range(6)}
    target = presorted_dp(snap, preds)
    assert set(target) == set(preds) and target["t5"] == "a"


def test_migration_only_when_gain_beats_reprefill() -> None:
    mig = GainMigrator()
    snap = snapshot(0.0, [inst("busy", 1, running=8, cap=16), inst("fast", 4)],
                    [traj("t", instance="busy", phase=Phase.TOOL, context=20000)])
    t = snap.trajectories["t"]
    assert mig.decide(snap, t, Prediction(20000, 0), "fast") is not None
    assert mig.decide(snap, t, Prediction(5, 0), "fast") is None


def test_migrations_are_decided_only_in_tool_gaps() -> None:
    """The policy is asked in tool gaps; the driver contract is checked in tests/bench."""
    policy = get_policy("progressive")
    t = traj("t", instance="i0", phase=Phase.TOOL, turns=3, generated=3000)
    snap = snapshot(0.0, [inst("i0")], [t])
    assert policy.on_tool_gap(snap, t) is None  # nowhere better to go: stays with its cache


def test_tail_merge_concentrates_idle_gpus_on_the_straggler() -> None:
    planner = TailMergePlanner()
    instances = [inst("home", running=1)] + [inst(f"idle{i}") for i in range(4)]
    snap = snapshot(100.0, instances, [traj("s", instance="home", phase=Phase.TOOL)])
    change = planner.plan(snap, {"s": Prediction(20000, 30000)})
    assert change is not None and change.launch == (4,) and len(change.retire) == 4


def test_tail_merge_never_swaps_an_instance_for_its_like() -> None:
    """An idle TP2 is already a TP2: retiring it for a new TP2 would drain and restart an
    engine for nothing (the demo printed such swaps: issue 44). Only smaller instances
    merge, and the scheduler and simulator drop any same-for-same relayout."""
    planner = TailMergePlanner()
    snap = snapshot(100.0, [inst("home", running=1), inst("pair", 2)],
                    [traj("s", instance="home", phase=Phase.TOOL)])
    assert planner.plan(snap, {"s": Prediction(20000, 30000)}) is None
    swap, merge = Relayout(("pair",), (2,)), Relayout(("pair",), (1, 1))
    assert not swap.changes(snap) and merge.changes(snap)


def test_joint_planner_merges_for_a_tail_and_not_for_a_crowd() -> None:
    planner = JointPlanner({4: 0.25})
    idle = [inst(f"i{i}") for i in range(8)]
    tail = snapshot(0.0, [inst("home", running=1), *idle], [traj("s", instance="home")])
    assert planner.plan(tail, {"s": Prediction(30000, 0)}) is not None
    crowd = [traj(f"c{i}", instance="home") for i in range(200)]
    busy = [inst(f"b{i}", running=4) for i in range(8)]
    snap = snapshot(0.0, [inst("home", running=4), *busy], crowd)
    assert planner.plan(snap, {c.id: Prediction(500, 0) for c in crowd}) is None


def test_oracle_reads_truth_only_through_its_constructor() -> None:
    pred = OraclePredictor(lambda tid, gen: 5000 - gen)
    t = traj("t", generated=1000)
    assert pred.predict(t, snapshot(0.0, [inst("a")], [t])).mean == 4000


def test_speed_model_interference() -> None:
    assert TPSpeed(0.01, 0.1).step_s(11) == pytest.approx(0.02)
