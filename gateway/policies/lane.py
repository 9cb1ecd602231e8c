"""Straggler lane: the predicted top-k trajectories on a lightly loaded high-TP instance.

Why: on a small pool a batch's makespan is bound by its longest trajectory's critical
path (``bench steps`` lower bound by component), and on a static all-TP8 pool that
straggler decodes inside a batch of every other sequence, each step lengthened by the
others' contexts. A lane keeps the few trajectories predicted to run longest on one
high-TP instance with at most ``k`` of them, so their steps stay close to a lone decode,
while the bulk packs on the others. What it gains, or does not, is measured in
``BENCHMARKS.md`` (why in ``docs/policies.md``), not kept here, where it would go stale.

Layout (:class:`LanePlanner`): every step starts with all GPUs at the highest TP
(``min(8, gpus)``); from 32 GPUs the first instance is the lane. With 8 GPUs that is one
TP8 instance, the best static layout, and there is no lane. The lane is tried in the
first step and kept for later steps only if it caught the trajectory that finished last
early enough;
otherwise the policy runs that layout as the best static baseline does (FCFS, verl's
routing: sticky, new trajectories round robin). Either way, trajectories off the lane
move between the other instances in their tool gaps to even out the KV context each one
holds (:class:`LaneMigrator`, :class:`~gateway.policies.resources.ContextBalancer`).
Nothing here reads a hidden length: the inputs are observed counters of trajectories
and the predictor's estimates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.policies.base import (
    GroupView,
    Migrate,
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
from gateway.policies.resources import ContextBalancer, GainMigrator, uniform_layout

#: the lane holds at most 1/MAX_LANE_SHARE of the up GPUs: on a smaller pool (two TP8
#: instances at 16 GPUs, two backends of a static pool) it would idle half the pool for
#: eight trajectories (measured at 16 GPUs: ``docs/policies.md``)
MAX_LANE_SHARE = 4


class LanePlacer:
    """Top-``k`` predicted-remaining trajectories to the lane, the rest to the bulk.

    The lane is the up instance with the highest TP (ties: smallest id) when it holds at
    most a quarter of the up GPUs; otherwise, or with the lane switched off, routing is
    verl's (``plain``: sticky, new trajectories round robin). Not slime's ``cache_aware``:
    it keeps a GRPO group on the instance holding the group's shared prompt, so a hard
    prompt's siblings share one engine; on static TP8 verl's routing is the faster of
    the two (``BENCHMARKS.md``). A
    bulk trajectory keeps its instance while it has a slot (prefix cache), else goes to
    the least-loaded bulk instance; a bulk call is held, not sent to the lane, when the
    bulk is full, so the lane stays light. A trajectory that fell out of the top-k stays
    on the lane while the lane runs fewer than ``k`` calls (its cache is there).
    """

    def __init__(self, k: int = 8, planner: LanePlanner | None = None, lanes: int = 1) -> None:
        self.k = k  # members per lane instance
        self.n_lanes = lanes  # lane instances (the highest-TP up instances, by id)
        self.planner = planner  # when given, its ``lane_on`` switches the lane off
        self.plain = StickyPlacer()  # without a lane: the verl baseline's routing
        self._lanes: tuple[str, ...] = ()
        self._home: dict[str, str] = {}  # member -> its lane instance

    @property
    def lane(self) -> str | None:
        return self._lanes[0] if self._lanes else None

    @property
    def lanes(self) -> tuple[str, ...]:
        return self._lanes

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._home)

    def refresh(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> None:
        up = sorted((i for i in snap.instances if i.up), key=lambda i: (-i.tp, i.id))
        lanes = up[:self.n_lanes]
        if (len(up) <= self.n_lanes
                or sum(i.tp for i in lanes) * MAX_LANE_SHARE > sum(i.tp for i in up)
                or (self.planner is not None and not self.planner.lane_on)):
            self._lanes, self._home = (), {}
            return
        self._lanes = tuple(i.id for i in lanes)
        live = [t for t in preds if t in snap.trajectories
                and snap.trajectories[t].phase is not Phase.FINISHED]
        live.sort(key=lambda t: (-preds[t].mean, t))
        top = live[:self.k * self.n_lanes]
        home = {t: self._home[t] for t in top if self._home.get(t) in self._lanes}
        count = dict.fromkeys(self._lanes, 0)
        for lane in home.values():
            count[lane] += 1
        for tid in top:  # newcomers: their own lane if they sit on one, else the emptiest
            if tid in home:
                continue
            at = snap.trajectories[tid].instance
            lane = at if at in count and count[at] < self.k else min(
                self._lanes, key=lambda i: (count[i], i))
            home[tid] = lane
            count[lane] += 1
        self._home = home
        if self.planner is not None:
            for tid in home:
                self.planner.joined_lane(tid, snap.trajectories[tid].generated_tokens)

    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        if not self._lanes or any(snap.instance(i) is None for i in self._lanes):
            return self.plain.choose(call, traj, pred, slots, snap)
        home = self._home.get(traj.id)
        if home is not None and home in slots.free:
            return home
        at = traj.instance
        if at in self._lanes and at in slots.free:
            view = snap.instance(at)
            if view is not None and view.running < self.k:
                return at
        bulk = {iid for iid in slots.free if iid not in self._lanes}
        if at in bulk:
            return at
        return least_loaded(slots, snap, bulk)

    def target_of(self, trajectory_id: str) -> str | None:
        return self._home.get(trajectory_id)


class LaneMigrator:
    """A lane member moves to its lane (:class:`GainMigrator`: when the decode time saved
    pays the re-prefill); any other trajectory may move between bulk instances to even
    out the context they hold (:class:`ContextBalancer`), never onto a lane."""

    def __init__(self, placer: LanePlacer, balance: bool = True) -> None:
        self.placer = placer
        self.gain = GainMigrator(locality=True)
        self.balancer = ContextBalancer() if balance else None

    def decide(self, snap: Snapshot, traj: TrajectoryView, pred: Prediction | None,
               target: str | None) -> Migrate | None:
        if target is not None:
            return self.gain.decide(snap, traj, pred, target)
        if self.balancer is None or traj.instance in self.placer.lanes:
            return None
        self.balancer.exclude = frozenset(self.placer.lanes)
        return self.balancer.decide(snap, traj, pred, None)


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
    layout when one straggler binds); :class:`LanePlacer` runs a lane only where it is
    at most a quarter of the pool (from 32 GPUs at TP8).
    """
    lane = 1
    while lane * 2 <= min(8, gpus):
        lane *= 2
    rest = gpus - lane
    return (lane,) + (uniform_layout(rest, min(bulk_tp, rest)) if rest else ())


class LanePlanner:
    """Per-step layout and lane switch (``observe`` counts finished trajectories and
    notes the last to finish; a new step starts when ``initial_layout`` is called again,
    as the simulator starts each batch with it, or, in a live gateway, at the first
    ``plan`` that finds every trajectory of the step finished).

    Every step starts with the lane layout (:func:`lane_layout`: all GPUs at the highest
    TP, the first instance the lane), because one high-TP instance serves a straggler
    fastest; with 8 GPUs this *is* the best static layout. No relayout inside a step,
    and none between steps by a throughput score: the fitted interference overstates
    work at high load, so such a score picks lower TP where the lane layout wins
    (``docs/policies.md``).

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
        self.choice = lane_layout(gpus, self.bulk_tp)
        self._next_step()
        return self.choice

    def _next_step(self) -> None:
        """Close the step that just ended (if any trajectory finished in it) and decide
        whether the next one runs with the lane."""
        if self.current.trajectories:
            self.last, self.current = self.current, StepLoad()
        # keep the lane only if it caught last step's straggler in time
        self.lane_on = True if self.last is None else self.last.lane_caught_straggler

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        """No relayout (the layout is chosen per step; the placer's refresh does the
        rest). A live gateway never calls :meth:`initial_layout` between RL steps, so a
        step also ends here: when trajectories finished and none is left running (the
        batch is over; the trainer's next one reuses the pool)."""
        if self.current.trajectories and all(
                t.phase is Phase.FINISHED for t in snap.trajectories.values()):
            self._next_step()
        return None
