"""Libra's bucket planner (arXiv 2606.03077, section 5: elastic GPU reallocation).

Buckets are the C-MLFQ levels (one TP degree each). Every ``plan_interval_s`` the planner
predicts each bucket's finishing time from the predicted remaining lengths of the
trajectories routed to it (the DP makespan over that bucket's instances) and considers
moving GPUs from one bucket to another (retiring idle instances only). A move is applied
only if it cuts the predicted makespan by at least ``min_gain`` (5% in the paper) net
of the reconfiguration cost.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from gateway.policies.base import Prediction, Relayout, Snapshot
from gateway.policies.dp import layout_makespan
from gateway.policies.placement import CMLFQPlacer
from gateway.policies.resources import idle_instances, mixed_layout, pick_gpus


class LibraPlanner:
    def __init__(self, placer: CMLFQPlacer, initial: Mapping[int, float],
                 plan_interval_s: float = 30.0, min_gain: float = 0.05) -> None:
        self.placer = placer
        self.initial = dict(initial)
        self.plan_interval_s = plan_interval_s
        self.min_gain = min_gain

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        return mixed_layout(gpus, self.initial)

    def _makespan(self, by_tp: Mapping[int, list[float]], counts: Mapping[int, int],
                  snap: Snapshot) -> float:
        worst = 0.0
        for tp, lengths in by_tp.items():
            if not counts.get(tp):
                if lengths:
                    return float("inf")
                continue
            lengths.sort(reverse=True)
            worst = max(worst, layout_makespan(lengths, [tp] * counts[tp], snap.speeds))
        return worst

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        if not preds:
            return None
        by_tp: dict[int, list[float]] = defaultdict(list)
        for tid, pred in preds.items():
            by_tp[self.placer.target_tp(snap.trajectories[tid])].append(pred.mean)
        counts: dict[int, int] = defaultdict(int)
        for inst in snap.instances:
            if inst.state in ("up", "starting"):
                counts[inst.tp] += 1
        base = self._makespan(by_tp, counts, snap)
        idle = idle_instances(snap, max_tp=16)
        best: tuple[float, Relayout] | None = None
        for donor in list(counts):
            for receiver, _ in self.placer.levels:
                if receiver == donor or receiver not in snap.speeds:
                    continue
                pool = [i for i in idle if i.tp == donor]
                gpus = max(donor, receiver)
                retire = pick_gpus(pool, gpus)
                if retire is None:
                    continue
                trial = dict(counts)
                trial[donor] -= len(retire)
                trial[receiver] = trial.get(receiver, 0) + gpus // receiver
                score = self._makespan(by_tp, trial, snap) + snap.restart_s
                if best is None or score < best[0]:
                    launch = (receiver,) * (gpus // receiver)
                    best = (score, Relayout(retire, launch, f"bucket TP{donor}->TP{receiver}"))
        if best is not None and base - best[0] >= self.min_gain * base:
            return best[1]
        return None
