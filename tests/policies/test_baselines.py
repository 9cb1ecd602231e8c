"""Baselines: FCFS order, least-loaded / round-robin / sticky placement, LAS, registry."""

from __future__ import annotations

import pytest

from gateway.policies.base import Dispatch, Policy
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


def test_slime_is_fcfs_and_least_loaded() -> None:
    policy = get_policy("slime")
    snap = snapshot(10.0, [inst("a", running=3), inst("b", running=1)],
                    [traj("late"), traj("early")])
    out = policy.schedule(snap, [call("late", t=9.0), call("early", t=1.0)])
    assert out[0] == Dispatch("early#0", "b", 1)
    assert [d.key for d in out] == ["early#0", "late#0"]


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


def test_oracle_needs_truth() -> None:
    with pytest.raises(ValueError, match="oracle_truth"):
        get_policy("oracle")
    assert "upper bound" in _policy("oracle").label
