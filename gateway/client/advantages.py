"""GRPO's group-relative advantages over a batch of samples.

A trajectory is one member of its group however many samples it gives (a side call, a
dropped reply or a compaction makes it several branches: ``branches="all"``): the
group's mean and spread are over its trajectories' rewards, one each, and every sample
of a trajectory gets its trajectory's advantage. A reward of None (a trajectory finished
without a score) is left out of the statistics and gives an advantage of 0: no signal.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from gateway.schema.samples import Sample

#: added to the group's standard deviation, so a group of equal rewards gives 0
EPS = 1e-4


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """Each sample's (reward - its group's mean) / (the group's std + ``EPS``), the mean and
    the (population) std over one reward per trajectory of the group; 0 without a reward."""
    rewards: dict[str | None, dict[str, float]] = {}
    for s in samples:
        if s.reward is not None:
            rewards.setdefault(s.group_id, {}).setdefault(s.trajectory_id, s.reward)
    stats = {g: (statistics.fmean(r.values()), statistics.pstdev(r.values()))
             for g, r in rewards.items()}
    out = []
    for s in samples:
        if s.reward is None or s.group_id not in stats:
            out.append(0.0)
            continue
        mean, std = stats[s.group_id]
        out.append((s.reward - mean) / (std + EPS))
    return out
