"""Libra as its code runs it: configs, causal prefix tree, bucket planner.

Sources: NetX-lab/Libra, ``infra/scheduling/cmlfq_prefix_tree.py`` and
``cmlfq_scheduler.py`` (the tree and C-MLFQ), ``configs/*cmlfq*qwen3_14b*.yaml`` (layouts
and thresholds), ``workflow/search_r1.py`` (what a "generated token" counts); the paper is
arXiv 2606.03077.

Bucket planner (section 5: elastic GPU reallocation).

Buckets are the C-MLFQ levels (one TP degree each). Every ``plan_interval_s`` the planner
predicts each bucket's finishing time from the predicted remaining lengths of the
trajectories routed to it (the DP makespan over that bucket's instances) and considers
moving GPUs from one bucket to another (retiring idle instances only). A move is applied
only if it cuts the predicted makespan by at least ``min_gain`` (5% in the paper) net
of the reconfiguration cost.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.policies.base import (
    GroupView,
    Phase,
    Prediction,
    Relayout,
    Snapshot,
    TrajectoryView,
)
from gateway.policies.dp import layout_makespan
from gateway.policies.placement import CMLFQPlacer
from gateway.policies.resources import idle_instances, mixed_layout, pick_gpus


@dataclass(frozen=True, slots=True)
class LibraConfig:
    """One of Libra's shipped C-MLFQ configurations for Qwen3-14B.

    ``initial``: fraction of the GPUs per TP degree (the config's instance list, repeated
    per node group); ``thresholds``: the bucket's ``max_tokens`` per TP degree, applied to
    remaining *generated plus tool-observation* tokens (Libra's workflows count every
    segment after the prompt: ``sum(len(tokens) for tokens, _, _ in segments[1:])``).
    """

    name: str
    initial: Mapping[int, float]
    thresholds: Mapping[int, int]
    source: str


LIBRA_CONFIGS = {
    # per 8-GPU node: TP1, TP1, TP2, TP4 (the 48-GPU R2E-Gym run, 16 of them rollout)
    "r2e": LibraConfig("r2e", {1: 0.25, 2: 0.25, 4: 0.5}, {1: 4000, 2: 12000, 4: 30000},
                       "configs/r2e_gym_qwen3_14b_mcore_gpu_6node48_100step.yaml"),
    # per 16 GPUs: TP2, TP2, TP4, TP8 (its Search-R1 run); needs 16 GPUs or more
    "search": LibraConfig("search", {2: 0.25, 4: 0.25, 8: 0.5},
                          {2: 5000, 4: 15000, 8: 40960},
                          "configs/search_r1_cmlfq_qwen3_14b.yaml"),
}


class _Node:
    """A tree node: the mean over every visit, the P90 over the last 200 (Libra's
    ``PrefixTreeNode.update_statistics``)."""

    __slots__ = ("children", "count", "mean", "recent")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.count = 0
        self.mean = 0.0
        self.recent: deque[int] = deque(maxlen=200)

    def add(self, remaining: int) -> None:
        self.count += 1
        self.mean += (remaining - self.mean) / self.count
        self.recent.append(remaining)

    def prediction(self) -> Prediction:
        s = sorted(self.recent)
        # numpy's default percentile (linear interpolation), as Libra computes it
        pos = 0.9 * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return Prediction(self.mean, s[lo] + (s[hi] - s[lo]) * (pos - lo))


class LibraTree:
    """Libra's causal prefix tree, as its code builds it.

    A path is the prompt id, then the tool states in order; a node keeps the remaining
    tokens seen after that prefix, where tokens are model output *and* tool observations
    (Libra's ``generated_tokens``). The root keeps whole lengths. Lookup starts at the
    prompt's own root if that prompt finished before, else at the global root, and walks
    as deep as the path matches (no minimum sample count). A node whose mean and P90 fall
    in different buckets moves nothing (the placer's rule); a trajectory with no node
    gets ``Prediction(0, inf)``, which no bucket pair agrees on, so it stays where it is.

    Observation tokens are read from the gateway's own counters: after call ``k``
    returns, its prompt is ``context_tokens - last_output_tokens``; the position of the
    ``k-1``-th tool return is that prompt minus the first.
    """

    name = "libra-tree"

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._global = _Node()
        self._prompts: dict[str, list[int]] = {}  # live trajectory -> prompt length per call

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        prompts = self._prompts.setdefault(traj.id, [])
        if traj.turns > len(prompts) and traj.turns >= 1:
            prompts.extend([-1] * (traj.turns - 1 - len(prompts)))
            prompts.append(traj.context_tokens - traj.last_output_tokens)
        if traj.phase is not Phase.FINISHED:
            return
        self._prompts.pop(traj.id, None)
        if not prompts or prompts[0] < 0:
            return
        first = prompts[0]
        total = traj.context_tokens - first
        root = self._roots.setdefault(traj.prompt_id, _Node())
        for node in (root, self._global):
            node.add(total)
            for d, state in enumerate(traj.outcomes):
                if d + 1 >= len(prompts) or prompts[d + 1] < 0:
                    break
                node = node.children.setdefault(state, _Node())
                node.add(max(0, total - (prompts[d + 1] - first)))

    def lookup(self, traj: TrajectoryView) -> _Node | None:
        node = self._roots.get(traj.prompt_id) or (self._global if self._global.count else None)
        if node is None:
            return None
        for state in traj.outcomes:
            child = node.children.get(state)
            if child is None:
                break
            node = child
        return node

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction:
        node = self.lookup(traj)
        return node.prediction() if node is not None else Prediction(0.0, float("inf"))


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
            if inst.placed:
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
