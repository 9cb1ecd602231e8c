"""A policy assembled from parts: predictor, prioritizer, placer, migrator, planner.

Every named policy is a :class:`ComposedPolicy`; the parts are the mechanisms of the
papers, so ablations are one constructor argument away. ``schedule`` is the one place
that turns parts into dispatches: sort the queue by the prioritizer, give each call the
instance its placer picks among those with a free slot (or hold it), stamp the vLLM
priority.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.policies.base import (
    Dispatch,
    GroupView,
    InstanceView,
    Migrate,
    PendingCall,
    Prediction,
    Relayout,
    Slots,
    Snapshot,
    TrajectoryView,
)
from gateway.policies.predict import Predictor

#: vLLM priorities are ints; keys are scaled and clamped into this range.
PRIORITY_LIMIT = 1_000_000


class Prioritizer(Protocol):
    def key(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
            now: float) -> float:
        """Smaller runs first (the queue order and the vLLM ``priority``)."""
        ...


class Placer(Protocol):
    def choose(self, call: PendingCall, traj: TrajectoryView, pred: Prediction | None,
               slots: Slots, snap: Snapshot) -> str | None:
        """An instance id from ``slots.free``, or None to hold the call in the queue."""
        ...

    def refresh(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> None:
        """Recompute any plan from fresh predictions (called by ``ComposedPolicy.plan``)."""
        ...

    def target_of(self, trajectory_id: str) -> str | None:
        """Where the placer would like this trajectory to be (a migration target)."""
        ...


class Migrator(Protocol):
    def decide(self, snap: Snapshot, traj: TrajectoryView, pred: Prediction | None,
               target: str | None) -> Migrate | None: ...


class Planner(Protocol):
    @property
    def plan_interval_s(self) -> float | None: ...

    def initial_layout(self, gpus: int) -> tuple[int, ...]: ...

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None: ...


def least_loaded(slots: Slots, snap: Snapshot, among: set[str] | None = None) -> str | None:
    """The instance with the most free slots (ties by id, for determinism)."""
    best: tuple[int, str] | None = None
    for iid, free in slots.free.items():
        if among is not None and iid not in among:
            continue
        cand = (-free, iid)
        if best is None or cand < best:
            best = cand
    return None if best is None else best[1]


@dataclass(slots=True)
class ComposedPolicy:
    """The :class:`~gateway.policies.base.Policy` every registry name builds."""

    name: str
    prioritizer: Prioritizer
    placer: Placer
    planner: Planner
    predictor: Predictor | None = None
    migrator: Migrator | None = None
    label: str = ""
    predictions: dict[str, Prediction] = field(default_factory=dict)

    @property
    def plan_interval_s(self) -> float | None:
        return self.planner.plan_interval_s

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        return self.planner.initial_layout(gpus)

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        """Feed the predictor; drop the cached prediction so the next turn re-predicts
        (Heddle's progressive priority: re-predicted at every turn and tool return)."""
        if self.predictor is not None:
            self.predictor.observe(traj, groups, now)
        learn = getattr(self.planner, "observe", None)  # planners that learn across steps
        if learn is not None:
            learn(traj, groups, now)
        self.predictions.pop(traj.id, None)

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction | None:
        if self.predictor is None:
            return None
        pred = self.predictions.get(traj.id)
        if pred is None:
            pred = self.predictions[traj.id] = self.predictor.predict(traj, snap)
        return pred

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        slots = Slots.of(snap)
        if not slots.free or not pending:
            return []
        keyed = []
        for call in pending:
            traj = snap.trajectories[call.trajectory_id]
            pred = self.predict(traj, snap)
            keyed.append((self.prioritizer.key(call, traj, pred, snap.now), call.key, call,
                          traj, pred))
        keyed.sort(key=lambda k: (k[0], k[1]))
        out: list[Dispatch] = []
        for key, _, call, traj, pred in keyed:
            target = self.placer.choose(call, traj, pred, slots, snap)
            if target is None:
                continue
            slots.take(target)
            prio = int(max(-PRIORITY_LIMIT, min(PRIORITY_LIMIT, key)))
            out.append(Dispatch(call.key, target, prio))
            if not slots.free:
                break
        return out

    def on_tool_gap(self, snap: Snapshot, traj: TrajectoryView) -> Migrate | None:
        if self.migrator is None:
            return None
        pred = self.predict(traj, snap)
        target = self.placer.target_of(traj.id)
        return self.migrator.decide(snap, traj, pred, target)

    def plan(self, snap: Snapshot) -> Relayout | None:
        preds: dict[str, Prediction] = {}
        if self.predictor is not None:
            for tid, traj in snap.trajectories.items():
                pred = self.predict(traj, snap)
                if pred is not None:
                    preds[tid] = pred
        self.placer.refresh(snap, preds)
        return self.planner.plan(snap, preds)

    def at_pause(self, snap: Snapshot) -> Relayout | None:
        """The engines are paused for a weight push (a step mode that never lets the pool
        idle changes layout here, if anywhere): the planner's relayout, if it has one."""
        hook = getattr(self.planner, "at_pause", None)
        return None if hook is None else hook(snap)


def up_instances(snap: Snapshot) -> list[InstanceView]:
    return [i for i in snap.instances if i.up]
