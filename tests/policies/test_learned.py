"""The learned predictor trains online and beats a constant on a planted signal."""

from __future__ import annotations

import pytest

from gateway.policies.base import GroupView, Phase
from gateway.policies.learned import LearnedPredictor
from tests.policies.fakes import inst, snapshot, traj

pytest.importorskip("torch")


def test_learns_group_rate_signal() -> None:
    pred = LearnedPredictor(seed=0, train_every=8, min_finished=16, steps=150)
    for k in range(48):
        rate = 200 if k % 2 else 2000
        tid, group = f"t{k}", f"g{k % 2}"
        total = rate * 10
        for turn in range(1, 10):
            t = traj(tid, group, turns=turn, generated=rate * turn, phase=Phase.TOOL)
            pred.predict(t, snapshot(0.0, [inst("a")], [t]))
            pred.observe(t, {}, 0.0)
        done = traj(tid, group, turns=10, generated=total, phase=Phase.FINISHED)
        pred.observe(done, {group: GroupView(group, (tid,))}, 0.0)
    heavy = traj("h", "g0", turns=2, generated=4000)
    light = traj("l", "g1", turns=2, generated=400)
    snap = snapshot(0.0, [inst("a")], [heavy, light])
    assert pred.predict(heavy, snap).mean > 3 * pred.predict(light, snap).mean
