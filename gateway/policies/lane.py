"""Straggler lane: the predicted top-k trajectories on a lightly loaded high-TP instance.

Why: on a small pool a batch's makespan is bound by its longest trajectory's critical
path (``bench steps`` lower bound by component), and on a static all-TP8 pool that
straggler decodes inside a batch of every other sequence (at 128 in flight a TP8 step is
~4.7x a lone one under the fitted speeds). A lane keeps the few trajectories predicted
to run longest on one high-TP instance with at most ``k`` of them, so their steps stay
close to a lone decode, while the bulk packs on the other instances.

Layout choice (:class:`LanePlanner`): the pool is one lane instance of TP
``min(8, gpus // 2)`` plus the rest at ``bulk_tp``, unless what the policy learned in
earlier steps says the lane cannot pay. After each step the planner compares, with the
fitted speeds, the lane layout and the best uniform layout on the last step's observed
load (trajectory count, tokens generated, the longest trajectory's tokens and tool
time); ``initial_layout`` of the next step takes the cheaper. Nothing here reads a
hidden length: the inputs are finished trajectories' observed counters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.policies.base import (
    GroupView,
    Phase,
    PendingCall,
    Prediction,
    Relayout,
    Slots,
    Snapshot,
    TPSpeed,
    TrajectoryView,
)
from gateway.policies.compose import least_loaded
from gateway.policies.resources import uniform_layout


class LanePlacer:
    """Top-``k`` predicted-remaining trajectories to the lane, the rest to the bulk.

    The lane is the up instance with the highest TP (ties: smallest id) when the pool has
    more than one instance; with one instance everything goes there. A bulk trajectory
    keeps its instance while it has a slot (prefix cache), else goes to the least-loaded
    bulk instance; a bulk call is held, not sent to the lane, when the bulk is full, so
    the lane stays light. A trajectory that fell out of the top-k stays on the lane while
    the lane runs fewer than ``k`` calls (its cache is there).
    """

    def __init__(self, k: int = 8, planner: LanePlanner | None = None) -> None:
        self.k = k
        self.planner = planner  # when given, its ``lane_on`` switches the lane off
        self._lane: str | None = None
        self._members: set[str] = set()

    @property
    def lane(self) -> str | None:
        return self._lane

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def refresh(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> None:
        up = [i for i in snap.instances if i.state == "up"]
        if len(up) < 2 or (self.planner is not None and not self.planner.lane_on):
            self._lane, self._members = None, set()
            return
        self._lane = min(up, key=lambda i: (-i.tp, i.id)).id
        live = [t for t in preds if t in snap.trajectories
                and snap.trajectories[t].phase is not Phase.FINISHED]
        live.sort(key=lambda t: (-preds[t].mean, t))
        self._members = set(live[:self.k])

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        lane = self._lane
        if lane is None or snap.instance(lane) is None:
            if traj.instance in slots.free:
                return traj.instance
            return least_loaded(slots, snap)
        if traj.id in self._members and lane in slots.free:
            return lane
        lane_view = snap.instance(lane)
        if (traj.instance == lane and lane in slots.free and lane_view is not None
                and lane_view.running < self.k):
            return lane
        bulk = {iid for iid in slots.free if iid != lane}
        if traj.instance in bulk:
            return traj.instance
        return least_loaded(slots, snap, bulk)

    def target_of(self, trajectory_id: str) -> str | None:
        return self._lane if trajectory_id in self._members else None


@dataclass(slots=True)
class StepLoad:
    """What one finished step looked like, from observed counters only."""

    trajectories: int = 0
    tokens: int = 0  # generated tokens, all trajectories
    longest_tokens: int = 0  # generated tokens of the trajectory that ran longest
    longest_tool_s: float = 0.0


def lane_layout(gpus: int, bulk_tp: int) -> tuple[int, ...]:
    """One lane instance of TP ``min(8, gpus)`` (a power of two) + the bulk at ``bulk_tp``.

    With 8 GPUs or fewer the lane is the whole pool (one instance: the best static
    layout when one straggler binds); the lane only splits off from 16 GPUs on.
    """
    lane = 1
    while lane * 2 <= min(8, gpus):
        lane *= 2
    rest = gpus - lane
    return (lane,) + (uniform_layout(rest, min(bulk_tp, rest)) if rest else ())


def estimate_makespan(layout: Sequence[int], load: StepLoad, speeds: Mapping[int, TPSpeed],
                      lane_k: int | None) -> float:
    """Crude makespan of ``load`` on ``layout``: max(straggler path, work / throughput).

    The straggler decodes its tokens at its instance's step time: on the lane (the first
    instance, ``lane_k`` given and more than one instance) with ``lane_k`` in its batch,
    on a uniform pool alone on the fastest instance (the bulk ends long before it: the
    optimistic case for the uniform layout, so the lane must win clearly to be chosen).
    The work term is total tokens over the summed per-instance throughput ``n / step(n)``
    at the bulk's even share per instance.
    """
    if not layout or any(tp not in speeds for tp in layout):
        return math.inf
    laned = lane_k is not None and len(layout) > 1
    bulk = list(layout[1:] if laned else layout)
    lane_n = min(lane_k or 0, load.trajectories) if laned else 0
    per_inst = max(1, round((load.trajectories - lane_n) / len(bulk)))
    if laned:
        straggler = load.longest_tokens * speeds[layout[0]].step_s(max(1, lane_n))
    else:
        straggler = load.longest_tokens * speeds[max(bulk)].step_s(1)
    rate = sum(per_inst / speeds[tp].step_s(per_inst) for tp in bulk)
    if lane_n:
        rate += lane_n / speeds[layout[0]].step_s(lane_n)
    return max(straggler + load.longest_tool_s, load.tokens / rate)


class LanePlanner:
    """Per-step layout: the lane layout or a uniform one, from the last step's load.

    ``observe`` is fed by the policy when a trajectory finishes; a new step is
    detected when ``initial_layout`` is called again (the driver starts each batch with
    it). Step 1 (nothing learned) takes the lane layout. No relayout inside a step: the
    lane is already the high-TP instance the straggler needs.
    """

    def __init__(self, k: int = 8, bulk_tp: int = 2, plan_interval_s: float = 2.0) -> None:
        self.k = k
        self.bulk_tp = bulk_tp
        self.plan_interval_s = plan_interval_s
        self.speeds: Mapping[int, TPSpeed] = {}
        self.current = StepLoad()
        self.last: StepLoad | None = None
        self.choice: tuple[int, ...] = ()
        self.lane_on = True

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        """Called by :class:`ComposedPolicy` with every observation; counts finished ones."""
        if traj.phase is not Phase.FINISHED:
            return
        cur = self.current
        cur.trajectories += 1
        cur.tokens += traj.generated_tokens
        if traj.generated_tokens > cur.longest_tokens:
            cur.longest_tokens = traj.generated_tokens
            cur.longest_tool_s = traj.tool_time_s

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        if self.current.trajectories:
            self.last, self.current = self.current, StepLoad()
        lane = lane_layout(gpus, self.bulk_tp)
        if self.last is None or not self.speeds:
            self.choice, self.lane_on = lane, True
            return lane
        best = (estimate_makespan(lane, self.last, self.speeds, self.k), lane, True)
        for tp in (1, 2, 4, 8):
            if tp <= gpus and tp in self.speeds:
                lay = uniform_layout(gpus, tp)
                cand = (estimate_makespan(lay, self.last, self.speeds, None), lay, False)
                if cand[0] < best[0]:
                    best = cand
        _, self.choice, self.lane_on = best
        return self.choice

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        self.speeds = snap.speeds
        return None
