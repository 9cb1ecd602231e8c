"""Straggler lane: the predicted top-k trajectories on a lightly loaded high-TP instance.

Why: on a small pool a batch's makespan is bound by its longest trajectory's critical
path (``bench steps`` lower bound by component), and on a static all-TP8 pool that
straggler decodes inside a batch of every other sequence (at 128 in flight a TP8 step is
~4.7x a lone one under the fitted speeds; the engine's own step time grows less, which
is one reason the lane measured no gain: ``docs/policies.md``). A lane keeps the few
trajectories predicted to run longest on one high-TP instance with at most ``k`` of
them, so their steps stay close to a lone decode, while the bulk packs on the others.

Layout (:class:`LanePlanner`): every step starts with all GPUs at the highest TP
(``min(8, gpus)``); the first instance is the lane. With 8 GPUs that is one TP8 instance,
the best static layout, and there is no lane. The lane is tried in the first step and
kept for later steps only if it caught the trajectory that finished last early enough;
otherwise the policy runs that layout as the best static baseline does (FCFS, verl's
routing: sticky, new trajectories round robin). Nothing here reads a hidden length: the
inputs are observed counters of trajectories and the predictor's estimates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.policies.base import (
    GroupView,
    PendingCall,
    Phase,
    Prediction,
    Relayout,
    Slots,
    Snapshot,
    TrajectoryView,
)
from gateway.policies.compose import least_loaded
from gateway.policies.placement import FCFS, ProgressivePriority, StickyPlacer
from gateway.policies.resources import uniform_layout


class LanePlacer:
    """Top-``k`` predicted-remaining trajectories to the lane, the rest to the bulk.

    The lane is the up instance with the highest TP (ties: smallest id) when the pool has
    more than one instance; with one instance, or with the lane switched off, routing is
    verl's (``plain``: sticky, new trajectories round robin). Not slime's ``cache_aware``:
    it keeps a GRPO group on the instance holding the group's shared prompt, so a hard
    prompt's siblings share one engine; on static TP8 at 64 GPUs verl's routing is 3-18%
    faster (``BENCHMARKS.md``), and ``ours-lane`` on search gained 9% from the switch. A
    bulk trajectory keeps its instance while it has a slot (prefix cache), else goes to
    the least-loaded bulk instance; a bulk call is held, not sent to the lane, when the
    bulk is full, so the lane stays light. A trajectory that fell out of the top-k stays
    on the lane while the lane runs fewer than ``k`` calls (its cache is there).
    """

    def __init__(self, k: int = 8, planner: LanePlanner | None = None) -> None:
        self.k = k
        self.planner = planner  # when given, its ``lane_on`` switches the lane off
        self.plain = StickyPlacer()  # without a lane: the verl baseline's routing
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
        if self.planner is not None:
            for tid in self._members:
                self.planner.joined_lane(tid, snap.trajectories[tid].generated_tokens)

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        lane = self._lane
        if lane is None or snap.instance(lane) is None:
            return self.plain.choose(call, traj, pred, slots, snap)
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
    last_id: str = ""  # the trajectory that finished last (it set the makespan)
    last_tokens: int = 0
    lane_joins: dict[str, int] = field(default_factory=dict)  # id -> tokens when it joined

    @property
    def lane_caught_straggler(self) -> bool:
        """The trajectory that finished last joined the lane with at least half of its
        tokens still to generate."""
        joined = self.lane_joins.get(self.last_id)
        return joined is not None and joined <= self.last_tokens / 2


class LanePriority:
    """Longest predicted remaining first (Heddle's progressive priority) while the lane is
    on; arrival order (the baselines' FCFS) when the planner switched it off, so a pool
    without a lane is scheduled as the verl baseline schedules it."""

    def __init__(self, planner: LanePlanner) -> None:
        self.planner = planner
        self.lpt = ProgressivePriority()
        self.fcfs = FCFS()

    def key(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
            now: float) -> float:
        if self.planner.lane_on:
            return self.lpt.key(call, traj, pred, now)
        return self.fcfs.key(call, traj, pred, now)


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


class LanePlanner:
    """Per-step layout and lane switch (``observe`` counts finished trajectories and
    notes the last to finish; a new step is detected when ``initial_layout`` is called again, as the
    driver starts each batch with it).

    Every step starts with the lane layout (:func:`lane_layout`: all GPUs at the highest
    TP, the first instance the lane), because one high-TP instance serves a straggler
    fastest; with 8 GPUs this *is* the best static layout. No relayout inside a step.
    (A switch to the best-throughput uniform layout when the last step looked
    work-bound, scored with the fitted speeds, was tried and removed: the fitted linear
    interference put math-code's work at 3.5x its true bound at 64 trajectories per GPU,
    so it moved to 2xTP4 and lost; see ``docs/policies.md``.)

    The lane itself is tried in the first step and kept only while it pays its way: if
    the trajectory that finished last in the last step did not join the lane with at
    least half of its tokens still to generate, the predictions could not find the
    straggler in time, and the next step runs as a plain pool (``lane_on`` False: FCFS
    and verl's routing, i.e. the best static baseline on that layout).
    """

    def __init__(self, k: int = 8, bulk_tp: int = 8, plan_interval_s: float = 2.0) -> None:
        self.k = k
        self.bulk_tp = bulk_tp
        self.plan_interval_s = plan_interval_s
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
        cur.last_id, cur.last_tokens = traj.id, traj.generated_tokens

    def joined_lane(self, trajectory_id: str, generated_tokens: int) -> None:
        """The placer put ``trajectory_id`` on the lane (first time counts)."""
        self.current.lane_joins.setdefault(trajectory_id, generated_tokens)

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        if self.current.trajectories:
            self.last, self.current = self.current, StepLoad()
        self.choice, self.lane_on = lane_layout(gpus, self.bulk_tp), True
        if self.last is not None:
            # keep the lane only if it caught last step's straggler in time
            self.lane_on = self.last.lane_caught_straggler
        return self.choice

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        return None  # the layout is chosen per step; the placer's refresh does the rest
