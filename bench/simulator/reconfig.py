"""The simulator's reconfigurations: layout changes (drain, then restart as the policy's
new instances) and the engine pauses of weight updates. A part of
:class:`bench.simulator.des.Simulator`, kept apart from its event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from backends.sim.profiles import LatencyProfile
from bench.simulator.state import Instance, SimStats, Traj
from bench.simulator.weights import WeightUpdater
from gateway.policies.base import InstanceState, PendingCall, Phase, Policy, Relayout, Snapshot

PLAN, UP, PAUSE, RESUME = 1, 2, 4, 5  # event kinds (bench.simulator.des has the others)


class _Config(Protocol):
    profiles: dict[int, LatencyProfile]
    restart_s: float


class Reconfiguring:
    """What :class:`~bench.simulator.des.Simulator` does to change its pool."""

    cfg: _Config
    policy: Policy
    now: float
    bs: int
    instances: dict[str, Instance]
    trajs: dict[str, Traj]
    req_owner: dict[str, str]
    pending: dict[str, PendingCall]
    relayouts: dict[int, tuple[Relayout, set[str]]]
    stats: SimStats
    weights: WeightUpdater | None
    on_resume: Callable[[], None] | None
    ext: list[tuple[float, int, int, object]]
    _snap: Snapshot | None
    _revision: int

    def _push(self, t: float, kind: int, payload: object) -> None:
        raise NotImplementedError

    def _kick(self, inst: Instance) -> None:
        raise NotImplementedError

    def _changed(self, tr: Traj) -> None:
        raise NotImplementedError

    def _next_id(self) -> int:
        raise NotImplementedError

    def snapshot(self) -> Snapshot:
        raise NotImplementedError

    # ------------------------------------------------------------------ weight updates
    def push_pause(self, t: float) -> None:
        self._push(t, PAUSE, None)

    def push_resume(self, t: float) -> None:
        self._push(t, RESUME, None)

    def _weight_event(self, kind: int) -> None:
        assert self.weights is not None
        if kind == PAUSE:
            self.weights.pause(self)
        else:
            self.weights.resume(self)
            self._revision += 1
            if self.on_resume is not None:
                self.on_resume()
            for inst in self.instances.values():
                self._kick(inst)
        for inst in list(self.instances.values()):
            if inst.state is InstanceState.DRAINING:
                self._maybe_stopped(inst)

    def relayout_at_pause(self) -> None:
        """The engines are frozen for a weight push: a policy may change the layout now
        (``at_pause``), for the cost of an engine start beyond the push. The retired
        instances' calls are aborted and go back to the gateway's queue, each to go on
        from the tokens it had (prompt + tokens so far, re-prefilled where it lands)."""
        hook = getattr(self.policy, "at_pause", None)
        if hook is None:
            return
        snap = self.snapshot()
        change = hook(snap)
        if change is None or not change.changes(snap) or not self._valid(change):
            return
        self.stats.reconfigurations += 1
        for iid in change.retire:
            inst = self.instances.pop(iid)
            for req, generated in inst.engine.live_requests():
                inst.engine.abort(req.id)
                owner = self.req_owner.pop(req.id, "")
                if owner:  # prewarms are dropped
                    self._requeue(self.trajs[owner], len(req.prompt_ids) + generated)
            if self.weights is not None:
                for h in [h for h in self.weights.held if h.instance == iid]:
                    self.weights.held.remove(h)
                    tr = self.trajs[h.owner]
                    self._requeue(tr, tr.prompt_len() + h.generated)
        self._snap = None
        self._revision += 1
        self._push(self.now + self.cfg.restart_s, UP, change.launch)

    def _requeue(self, tr: Traj, tokens: int) -> None:
        """A running call whose instance a relayout retired: back to the queue, to go on
        from ``tokens`` (its prompt and what it generated) wherever it is placed next."""
        tr.partial = tokens - tr.prompt_len()
        tr.llm_s += self.now - tr.dispatched_at
        tr.instance = None
        tr.phase = Phase.QUEUED
        tr.enqueued_at = self.now
        self._changed(tr)
        key = f"{tr.spec.id}#{tr.turn}"
        self.pending[key] = PendingCall(key, tr.spec.id, tr.turn, tr.prompt_len(), self.now)

    # ------------------------------------------------------------------ layout
    def _plan(self) -> None:
        interval = self.policy.plan_interval_s
        if interval:
            self._push(self.now + interval, PLAN, None)
        snap = self.snapshot()
        change = self.policy.plan(snap)
        if change is None or not change.changes(snap) or not self._valid(change):
            return
        rid = self._next_id()
        self.relayouts[rid] = (change, set(change.retire))
        self.stats.reconfigurations += 1
        for iid in change.retire:
            inst = self.instances[iid]
            inst.state = InstanceState.DRAINING
            inst.relayout = rid
            self._maybe_stopped(inst)

    def _valid(self, change: Relayout) -> bool:
        insts = [self.instances.get(i) for i in change.retire]
        if any(i is None or i.state is not InstanceState.UP for i in insts):
            return False
        gpus = sum(i.tp for i in insts if i is not None)
        return gpus == sum(change.launch) and all(tp in self.cfg.profiles for tp in change.launch)

    def _maybe_stopped(self, inst: Instance) -> None:
        if inst.busy or inst.engine.has_work or inst.relayout is None:
            return
        if self.weights is not None and self.weights.holds(inst.id):
            return  # an aborted call is continued here after the resume
        change, left = self.relayouts[inst.relayout]
        left.discard(inst.id)
        del self.instances[inst.id]
        self._snap = None
        self._revision += 1
        if not left:
            del self.relayouts[inst.relayout]
            self._push(self.now + self.cfg.restart_s, UP, change.launch)

