"""Typed fakes for policy tests: hand-built snapshots and views, time passed explicitly."""

from __future__ import annotations

from gateway.policies.base import (
    GroupView,
    InstanceState,
    InstanceView,
    PendingCall,
    Phase,
    Snapshot,
    TPSpeed,
    TrajectoryView,
)

SPEEDS = {1: TPSpeed(0.0136, 0.083, 7.5e-5), 2: TPSpeed(0.010, 0.057, 5.5e-5),
          4: TPSpeed(0.0085, 0.034, 4.1e-5), 8: TPSpeed(0.0084, 0.018, 3.3e-5)}


def inst(iid: str, tp: int = 1, running: int = 0, cap: int = 4,
         state: InstanceState = InstanceState.UP) -> InstanceView:
    return InstanceView(iid, tp, tp, state, running, cap)


def traj(tid: str, group: str = "g0", turns: int = 0, generated: int = 0,
         instance: str | None = None, phase: Phase = Phase.QUEUED,
         outcomes: tuple[str, ...] = (), context: int = 1000) -> TrajectoryView:
    return TrajectoryView(tid, group, f"prompt-{group}", 0.0, turns, context, generated,
                          outcomes=outcomes, instance=instance, phase=phase)


def call(tid: str, t: float = 0.0, seq: int = 0) -> PendingCall:
    return PendingCall(f"{tid}#{seq}", tid, seq, 1000, t)


def snapshot(now: float, instances: list[InstanceView], trajs: list[TrajectoryView],
             groups: list[GroupView] | None = None, finished: int = 0) -> Snapshot:
    if groups is None:
        members: dict[str, list[str]] = {}
        for t in trajs:
            members.setdefault(t.group_id, []).append(t.id)
        groups = [GroupView(g, tuple(m)) for g, m in members.items()]
    return Snapshot(now, sum(i.gpus for i in instances), tuple(instances),
                    {t.id: t for t in trajs}, {g.id: g for g in groups}, SPEEDS,
                    finished=finished)
