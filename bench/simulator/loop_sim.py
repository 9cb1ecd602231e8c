"""The simulator as an RL loop drives it: trajectories added and dropped while it runs,
and the tool sandboxes they hold (one per running trajectory), which ``bench loop``
reports beside its throughput (the loop itself: bench/simulator/loop.py)."""

from __future__ import annotations

from bench.simulator.des import READY, SimConfig, Simulator
from bench.simulator.state import Traj
from bench.workloads import TrajectorySpec
from gateway.dispatch.speeds import SpeedMeter
from gateway.policies.base import InstanceState, Phase


class LoopSim(Simulator):
    """The simulator with trajectories added and aborted while it runs."""

    def __init__(self, policy: object, cfg: SimConfig, beliefs: SpeedMeter | None = None) -> None:
        super().__init__([], policy, cfg, beliefs=beliefs)  # type: ignore[arg-type]
        self.dropped: set[str] = set()
        #: tool sandboxes: one held by every trajectory from its start to its end or drop
        self.sandboxes = 0
        self.sandbox_s = 0.0  # sandbox-seconds held so far
        self.sandbox_peak = 0  # the most held at once since the trainer last took a batch
        self._sandbox_t = 0.0

    def hold(self, n: int) -> None:
        self.sandbox_s += self.sandboxes * (self.now - self._sandbox_t)
        self._sandbox_t = self.now
        self.sandboxes += n
        self.sandbox_peak = max(self.sandbox_peak, self.sandboxes)

    def add(self, specs: list[TrajectorySpec]) -> None:
        self.hold(len(specs))
        for s in specs:
            tr = Traj(s, len(self.trajs))
            self.trajs[s.id] = tr
            self._push(self.now + s.setup_s, READY, tr)
        self._revision += 1

    def drop(self, tid: str) -> None:
        """Abort a trajectory wherever it is: queued, generating, frozen or in a tool gap."""
        tr = self.trajs[tid]
        if tid in self.dropped or tr.phase is Phase.FINISHED:
            return
        self.dropped.add(tid)
        self.hold(-1)
        key = f"{tid}#{tr.turn}"
        self.pending.pop(key, None)
        if tr.request and self.req_owner.get(tr.request):
            key = tr.request
            inst = self.instances[tr.instance or ""]
            inst.engine.abort(key)
            self.req_owner[key] = ""  # a step already in flight may still report it
            inst.running -= 1
            if inst.state is InstanceState.DRAINING:
                self._maybe_stopped(inst)
        if self.weights is not None:
            self.weights.held = [h for h in self.weights.held if h.owner != tid]
        was_live = self.live.pop(tid, None) is not None
        tr.phase = Phase.FINISHED
        self._changed(tr)
        if was_live:
            self.policy.observe(tr.view(), self.groups, self.now)

    def _ready(self, tr: Traj) -> None:
        if tr.spec.id not in self.dropped:
            super()._ready(tr)

    def _finish(self, tr: Traj) -> None:
        if tr.spec.id not in self.dropped:
            self.hold(-1)
            super()._finish(tr)

    def run_until(self, done: object) -> None:
        while not done():  # type: ignore[operator]
            if not self.ext and not self.steps:
                raise RuntimeError("the loop stalled: no event left before the last step")
            self._next_event()
