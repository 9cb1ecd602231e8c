"""Baselines: FCFS order, least-loaded / round-robin / sticky placement, LAS, registry."""

from __future__ import annotations

import pytest

from gateway.policies.base import Dispatch, PendingCall, Policy
from gateway.policies.registry import POLICY_NAMES, get_policy
from tests.policies.fakes import call, inst, snapshot, traj


def _policy(name: str) -> Policy:
    return get_policy(name, oracle_truth=lambda tid, gen: 1000 - gen)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_dispatches_each_call_at_most_once_and_within_caps(name: str) -> None:
    policy = _policy(name)
    instances = [inst(f"i{k}", cap=2) for k in range(3)]
    trajs = [traj(f"t{k}", group=f"g{k % 2}") for k in range(10)]
    snap = snapshot(5.0, instances, trajs)
    out = policy.schedule(snap, [call(t.id, t=float(k)) for k, t in enumerate(trajs)])
    keys = [d.key for d in out]
    assert len(keys) == len(set(keys))
    for i in instances:
        assert sum(d.instance == i.id for d in out) <= i.cap
    assert len(out) == 6  # every free slot used: no policy idles GPUs with work queued


def test_slime_is_fcfs_and_starts_on_the_emptiest_cache() -> None:
    policy = get_policy("slime")
    snap = snapshot(10.0, [inst("a", running=3), inst("b", running=1)],
                    [traj("late"), traj("early")])
    out = policy.schedule(snap, [call("late", t=9.0), call("early", t=1.0)])
    assert out[0] == Dispatch("early#0", "b", 1)
    assert [d.key for d in out] == ["early#0", "late#0"]


def test_slime_routes_by_prefix_match_until_the_pool_is_imbalanced() -> None:
    """sgl-router cache_aware: follow-up calls and group siblings go where their prefix
    was sent, even to the busier worker; past |max-min| > 64 and max > 1.5 min, the call
    goes to the least-loaded worker instead."""
    policy = get_policy("slime")
    pool = [inst("a", cap=256), inst("b", running=2, cap=256)]
    first = policy.schedule(snapshot(0.0, pool, [traj("t")]), [call("t")])
    assert first == [Dispatch("t#0", "a", 0)]
    busy_a = [inst("a", running=30, cap=256), inst("b", running=2, cap=256)]
    follow = PendingCall("t#1", "t", 1, 1600, 5.0)  # context 1000 + tool result
    snap = snapshot(5.0, busy_a, [traj("t", turns=1, instance="a"), traj("sib")])
    out = policy.schedule(snap, [follow, call("sib", t=6.0)])
    assert [(d.key, d.instance) for d in out] == [("t#1", "a"), ("sib#0", "a")]
    # a prompt nobody has seen goes to the worker with the smallest tree
    fresh = policy.schedule(snapshot(7.0, busy_a, [traj("new", group="g9")]), [call("new")])
    assert fresh[0].instance == "b"
    imbalanced = [inst("a", running=100, cap=256), inst("b", running=20, cap=256)]
    again = PendingCall("t#2", "t", 2, 2400, 9.0)
    out = policy.schedule(snapshot(9.0, imbalanced, [traj("t", turns=2, instance="a")]),
                          [again])
    assert out[0].instance == "b"


def test_static_layout_names_fix_the_pool_tp() -> None:
    for base in ("slime", "verl"):
        for tp in (1, 2, 4, 8):
            p = get_policy(f"{base}-tp{tp}")
            assert p.initial_layout(64) == (tp,) * (64 // tp)
            assert p.name == f"{base}-tp{tp}"
    with pytest.raises(ValueError):
        get_policy("slime-tp3")


def test_verl_sticks_and_waits_for_its_instance() -> None:
    policy = get_policy("verl")
    snap = snapshot(0.0, [inst("a", running=4), inst("b")], [traj("t", instance="a", turns=1)])
    assert policy.schedule(snap, [call("t")]) == []


def test_verl_star_leaves_when_the_load_gap_exceeds_the_threshold() -> None:
    policy = get_policy("verl-star")
    snap = snapshot(0.0, [inst("a", running=8, cap=8), inst("b")],
                    [traj("t", instance="a", turns=1)])
    assert [d.instance for d in policy.schedule(snap, [call("t")])] == ["b"]


def test_round_robin_cycles() -> None:
    policy = get_policy("round-robin")
    snap = snapshot(0.0, [inst("a"), inst("b")], [traj("x"), traj("y")])
    first = policy.schedule(snap, [call("x")])[0].instance
    second = policy.schedule(snap, [call("y")])[0].instance
    assert {first, second} == {"a", "b"}


def test_las_runs_least_attained_service_first() -> None:
    from dataclasses import replace

    policy = get_policy("las")
    hog = replace(traj("hog"), llm_time_s=50.0)
    snap = snapshot(0.0, [inst("a", cap=1)], [hog, traj("new")])
    assert [d.key for d in policy.schedule(snap, [call("hog"), call("new", t=5.0)])] == ["new#0"]


def test_unknown_policy_lists_names() -> None:
    with pytest.raises(ValueError, match="available: slime"):
        get_policy("nope")


@pytest.mark.parametrize("name", ["progressive-oracle", "straggler-lane-oracle"])
def test_perfect_predictor_needs_truth_and_is_not_called_a_bound(name: str) -> None:
    with pytest.raises(ValueError, match="oracle_truth"):
        get_policy(name)
    label = _policy(name).label
    assert label.endswith("perfect predictor") and "bound" not in label


def test_verl_deals_new_trajectories_round_robin() -> None:
    """New trajectories go round robin (least-loaded would put both on ``a``)."""
    policy = get_policy("verl")
    snap = snapshot(0.0, [inst("a"), inst("b", running=3)], [traj("x"), traj("y")])
    out = policy.schedule(snap, [call("x", t=0.0), call("y", t=1.0)])
    assert sorted(d.instance for d in out) == ["a", "b"]


def test_a_mixed_pool_deals_new_trajectories_by_gpus() -> None:
    """Replay's probe layout runs TP4, TP2 and TP1 side by side: round robin would hand the
    one-GPU instance as many trajectories as the four-GPU one. Dealt per GPU, 14 new
    trajectories go 8 / 4 / 2."""
    policy = get_policy("verl")
    pool = [inst("a", tp=4, cap=64), inst("b", tp=2, cap=64), inst("c", tp=1, cap=64)]
    names = [f"t{i:02d}" for i in range(14)]
    snap = snapshot(0.0, pool, [traj(n) for n in names])
    out = policy.schedule(snap, [call(n, t=float(i)) for i, n in enumerate(names)])
    dealt = [d.instance for d in out]
    assert {i: dealt.count(i) for i in "abc"} == {"a": 8, "b": 4, "c": 2}
