"""Layout by replay: each step's TP degree chosen by replaying the last step on each layout.

Which uniform TP serves a batch fastest depends on the model, the GPU, the load and the
workload, and on the least certain constant of the cost model, how well tensor
parallelism scales (``docs/tp-efficiency.md``): on one calibration TP8 wins nearly
everywhere, on another TP2 or TP4 does. So no TP degree is written here. Before each
step, :class:`ReplayPlanner` replays the trajectories it *observed* in the last step
(their turns: new prompt tokens, generated tokens, the tool time before each call) on
every candidate layout with the per-TP speeds the driver measured (``Snapshot.speeds``),
and runs the step on the fastest. The straggler lane of :mod:`gateway.policies.lane`
rides on top of that layout where the pool is large enough for it.

The replay (:func:`~gateway.policies.fluid.replay_makespan`) is a fluid model of vLLM's
continuous batching on verl's routing (:mod:`gateway.policies.fluid`): an estimate for
ranking layouts, not the simulator.

The speeds are what the gateway believes (:class:`~gateway.dispatch.speeds.SpeedMeter`:
the latency profile, corrected per TP by what the engines measured; a degree no engine
has run takes the trend of the nearest measured ones). How well TP scales is the least
certain constant, and it is exactly what a correction borrowed from another degree gets
wrong, so the first step, which has no sample to replay anyway, runs a *probe layout*
(:func:`probe_layout`): one instance of every degree the pool can hold, the rest at the
highest. Its cost is that step's makespan, which the benchmarks report. A pool too small
to hold every degree at once (two GPUs cannot run a TP1 and a TP2 together), or a live
pool started on a layout of its operator's, has degrees no engine measured
(``Snapshot.borrowed``): one whose estimate on the borrowed factor is within
:data:`EXPLORE_MARGIN` of the best is run for one step (the cheapest such first), once,
and the choice after that rests on its own measurement.

Nothing here reads a hidden length, ``max_tokens`` or a workload hint: the sample is what
the gateway saw of finished trajectories.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from gateway.policies.base import (
    GroupView,
    Phase,
    Prediction,
    Relayout,
    Snapshot,
    TPSpeed,
    TrajectoryView,
)
from gateway.policies.fluid import (
    MAX_NUM_SEQS,
    StepRecorder,
    Turn,
    instance_s,
    probe_layout,
    replay_makespan,
)
from gateway.policies.lane import MAX_LANE_SHARE, LanePlanner, lane_layout
from gateway.policies.resources import uniform_layout

__all__ = ["EXPLORE_MARGIN", "LANE_MARGIN", "MAX_NUM_SEQS", "ReplayPlanner", "StepRecorder", "Turn",
           "probe_layout", "replay_makespan"]

#: how much faster a lane layout's replay must be than the best uniform one (its estimate
#: puts the sample's longest on the lane from the start, which no predictor achieves)
LANE_MARGIN = 0.10
#: a degree the pool has never run is run for one step where the replay, on the factor it
#: borrows from a degree that was measured, puts it within this of the best: how fast one
#: TP doubling is, is what a borrowed factor gets wrong, and the published band for it
#: (TP8/TP1 from 1.15x to 4.7x, docs/tp-efficiency.md) spans 4.1x over three doublings,
#: 1.6x a doubling
EXPLORE_MARGIN = 1.6


class ReplayPlanner(LanePlanner):
    """The straggler lane's planner with its bulk TP chosen by replay, not fixed at 8.

    ``estimates`` holds the last replay per candidate TP (seconds), ``bulk_tp`` the
    choice; a new choice needs to beat the current one by ``min_gain`` (noise between
    samples is larger than that). The lane (one TP-``min(8, gpus)`` instance for the
    predicted stragglers) is added where it holds at most a quarter of the pool and its
    rule keeps it on (:class:`~gateway.policies.lane.LanePlanner`).

    Between steps the choice is free in the simulator, which starts every step from
    :meth:`initial_layout` (the trainer's step hides a restart); a live gateway never
    calls that, so :meth:`plan` asks for the new layout as a relayout once the pool is
    idle (no trajectory running) and a step has been observed. Until then the pool keeps
    the layout it was started with: that is what the speeds are first measured on, so a
    mixed start (TP1 and TP2 instances, say) lets the first choice rest on two measured
    degrees rather than one.
    """

    def __init__(self, k: int = 8, plan_interval_s: float = 2.0, min_gain: float = 0.03,
                 degrees: Sequence[int] = (1, 2, 4, 8), probe: bool = True) -> None:
        super().__init__(k, bulk_tp=max(degrees), plan_interval_s=plan_interval_s)
        self.min_gain = min_gain
        self.probe = probe  # the first step runs probe_layout (every degree measured)
        self.degrees = tuple(sorted(degrees))
        self.recorder = StepRecorder()
        self.speeds: Mapping[int, TPSpeed] = {}
        self.estimates: dict[int, float] = {}  # uniform layouts, by TP
        self.lane_estimates: dict[int, float] = {}  # a lane + the bulk at TP
        self.with_lane = True  # the lane layout was chosen (until a replay says otherwise)
        self.gpus = 0
        self.time_scale = 1.0  # the observed (wall) tool times, in the speeds' time
        self.borrowed: frozenset[int] = frozenset()  # degrees no engine here measured
        self.explored: set[int] = set()  # degrees run once to be measured
        self.exploring: int | None = None  # the degree chosen to be measured, not on merit

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        super().observe(traj, groups, now)
        self.recorder.observe(traj)

    def _lane_fits(self, gpus: int) -> bool:
        return lane_layout(gpus, 8)[0] * MAX_LANE_SHARE <= gpus

    def _has_lane(self, gpus: int) -> bool:
        return self.lane_on and self._lane_fits(gpus)

    def layout_for(self, gpus: int) -> tuple[int, ...]:
        if self._has_lane(gpus):
            return lane_layout(gpus, self.bulk_tp)
        return uniform_layout(gpus, min(self.bulk_tp, gpus))

    def _choose(self, gpus: int) -> None:
        """Replay the last step's sample on each uniform layout and, where a lane fits
        and its rule keeps it on, on each lane layout (the sample's ``k`` longest on the
        lane, the rest round robin over the bulk); keep the current choice unless another
        is ``min_gain`` faster. The lane estimate assumes the predictor finds the longest:
        the lane's own rule (it caught the last finisher) guards against one that does
        not."""
        sample = self.recorder.sample
        speeds = {tp: s for tp, s in self.speeds.items() if s.fixed_s > 0 or s.seq_s > 0}
        if not sample or not speeds:
            return
        ts = self.time_scale
        prompts = self.recorder.prompts
        self.estimates = {tp: replay_makespan(sample, uniform_layout(gpus, tp), speeds, ts,
                                              prompts)
                          for tp in self.degrees if tp in speeds and tp <= gpus}
        self.lane_estimates = {}
        lane_tp = lane_layout(gpus, 8)[0]
        if self.lane_on and self._lane_fits(gpus) and lane_tp in speeds:
            ranked = sorted(range(len(sample)),
                            key=lambda i: -sum(x.output_tokens for x in sample[i]))
            on_lane = set(ranked[:self.k])
            rest = [i for i in range(len(sample)) if i not in on_lane]  # arrival order
            lane_s = instance_s([sample[i] for i in ranked[:self.k]], speeds[lane_tp], ts,
                                 [prompts[i] for i in ranked[:self.k]])
            self.lane_estimates = {
                tp: max(lane_s, replay_makespan([sample[i] for i in rest],
                                                uniform_layout(gpus - lane_tp, tp), speeds,
                                                ts, [prompts[i] for i in rest]))
                for tp in self.estimates}
        options = {(False, tp): v for tp, v in self.estimates.items()}
        # the lane's estimate assumes the predictor spots the longest from their first
        # call; it does not, so the lane must win by LANE_MARGIN to be chosen
        options.update({(True, tp): v * (1 + LANE_MARGIN)
                        for tp, v in self.lane_estimates.items()})
        if not options:
            return
        best = min(options, key=lambda o: (options[o], not o[0], -o[1]))
        if math.isinf(options[best]):
            return
        cur = options.get((self.with_lane, self.bulk_tp))
        if cur is None or options[best] * (1 + self.min_gain) < cur:
            self.with_lane, self.bulk_tp = best
        self.lane_on = self.lane_on and self.with_lane
        # a degree no engine measured is run once if its borrowed estimate comes near the best
        self.exploring = None
        if self.bulk_tp not in self.borrowed:
            untried = sorted((v, tp) for tp, v in self.estimates.items()
                             if tp in self.borrowed and tp not in self.explored
                             and v <= options[best] * EXPLORE_MARGIN)
            if untried:
                self.bulk_tp = self.exploring = untried[0][1]
                self.explored.add(self.exploring)

    def _next_step(self) -> None:
        super()._next_step()
        self.recorder.close()
        if self.gpus:
            self._choose(self.gpus)

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        self.gpus = gpus
        self._next_step()
        if self.probe and not self.recorder.sample:
            self.choice = probe_layout(gpus, [d for d in self.degrees if d <= gpus])
        else:
            self.choice = self.layout_for(gpus)
        return self.choice

    def _reason(self, chosen: str) -> str:
        if self.exploring is None:
            return chosen
        return (f"replay: measuring TP{self.exploring}, which no engine of this pool has run "
                f"(on the factor it borrows, its estimate is within {EXPLORE_MARGIN}x of the "
                "best)")

    def at_pause(self, snap: Snapshot) -> Relayout | None:
        """The engines are paused for a weight push. Where the step mode never lets the
        pool go idle (async, carried groups), :meth:`plan` never relays it out, so the
        layout changes here: the trajectories finished since the last choice are the
        sample, and every instance is replaced by the chosen layout (the calls they ran
        go on, re-prefilled, on the new instances; the engine start beyond the push is the
        cost, which the 3% gain a new choice needs stands for)."""
        self.speeds, self.gpus, self.time_scale = snap.speeds, snap.total_gpus, snap.time_scale
        self.borrowed = snap.borrowed
        if not snap.total_gpus or any(not i.up for i in snap.instances):
            return None
        self.recorder.close(keep_live=True)
        if not self.recorder.sample:
            return None  # nothing finished yet: the layout it runs is what gets measured
        self._choose(snap.total_gpus)
        return self._relayout(snap, self._reason(
            f"replay at the weight push: TP{self.bulk_tp} fastest for the trajectories "
            "since the last push"))

    def _relayout(self, snap: Snapshot, reason: str) -> Relayout | None:
        want = self.layout_for(snap.total_gpus)
        have = sorted(i.tp for i in snap.instances)
        if sorted(want) == have or sum(want) != sum(have):
            return None
        self.choice = want
        return Relayout(tuple(i.id for i in snap.instances), want, reason)

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        self.speeds = snap.speeds
        self.gpus = snap.total_gpus
        self.time_scale = snap.time_scale
        self.borrowed = snap.borrowed
        super().plan(snap, preds)  # closes a finished step (and chooses) in a live gateway
        running = [t for t in snap.trajectories.values() if t.phase is not Phase.FINISHED]
        if (not self.recorder.sample or not snap.total_gpus or running
                or any(not i.up for i in snap.instances)):
            return None  # nothing observed yet (the start layout is what gets measured)
        return self._relayout(snap, self._reason(
            f"replay: TP{self.bulk_tp} fastest for the last step's workload"))
