"""Discrete-event simulator: policy objects + simulated vLLM engines on a virtual clock.

The loop has two event sources: engine step ends (one in flight per busy engine) and
external events (a call becoming ready after its tool gap, planner ticks, restarted
instances coming up). An engine fuses identical decode steps up to the next external
event (``EngineCore.step(horizon_s)``), capped at ``max_fuse_s`` so a call routed to a
busy engine by a step end elsewhere waits at most that long for the batch boundary.
The gateway side is modelled as in ``gateway/dispatch``: a queue, a per-instance
concurrency cap, the policy's priority stamped on every request, prewarms
(``max_tokens: 1``) for migrations, drain-and-restart for layout changes. Each scheduling
pass *is* the gateway's: ``gateway/dispatch/step.py``'s ``schedule_pass``, the pure step the
live scheduler runs (cap, retries, stale calls, a raising policy isolated to the calls it
raises on: such a call fails and its trajectory ends there).

Admission is the engine's, as in vLLM: the gateway cap defaults to the engine's
``max_num_seqs`` per *instance* (whatever its TP), and the engine itself admits by its
token budget per step and free KV blocks, queueing the rest. (A per-GPU gateway cap kept
TP1 instances far below their compute knee and made high TP win at every load.)

Policies see what a live gateway sees: a trajectory appears (in the snapshot and its
group) when its first call arrives, and it is known to be finished only when the client
says so (``/finish``, one request overhead after its last call returned); until then a
trajectory whose last call returned is in its tool gap like any other. The per-TP speeds
they plan with are either the band's own (``beliefs=None``: the policy is told how the
engines run) or a :class:`~gateway.dispatch.speeds.SpeedMeter` fed as the live gateway feeds
it (each call's decode time from its first token on, its instance's running calls), whose
prior is the calibrated profile: a degree no engine has run is believed to scale as the
nearest one measured.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from backends.sim.engine import EngineCore
from backends.sim.profiles import LatencyProfile
from backends.sim.request import SimRequest, StepOutput
from bench.simulator.reconfig import PAUSE, PLAN, RESUME, UP, Reconfiguring
from bench.simulator.state import Instance, LiveViews, SimStats, Traj
from bench.simulator.weights import DEFAULT_UPDATE_S, WeightUpdater
from bench.workloads import TrajectorySpec
from gateway.dispatch.speeds import SpeedMeter
from gateway.dispatch.step import PassKey, Queued, schedule_pass
from gateway.policies.base import (
    GroupView,
    InstanceState,
    PendingCall,
    Phase,
    Policy,
    Relayout,
    Snapshot,
    TPSpeed,
)

READY, FINISH, CALL = 0, 3, 6  # event kinds (the others: bench.simulator.reconfig)
OVERHEAD_S = 0.005  # API server + tokenization per request (profile.request_overhead_ms)


@dataclass(slots=True)
class SimConfig:
    gpus: int
    profiles: dict[int, LatencyProfile]
    speeds: dict[int, TPSpeed]
    cap_per_gpu: int | None = None  # None: the engine's max_num_seqs per instance
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    restart_s: float = 10.8
    max_fuse_s: float = 1.0
    seed: int = 0
    # weight updates (bench/simulator/weights.py): every N s of the batch, None = off
    weight_update_every_s: float | None = None
    weight_update_mode: str = "wait"  # wait | keep | abort-and-continue
    weight_update_s: float = DEFAULT_UPDATE_S  # the update itself, engines paused


class Simulator(Reconfiguring):
    """Run one batch of ``specs`` under ``policy``; see :meth:`run`."""

    cfg: SimConfig

    def __init__(self, specs: list[TrajectorySpec], policy: Policy, cfg: SimConfig,
                 progress: Callable[[int], None] | None = None, start_s: float = 0.0,
                 beliefs: SpeedMeter | None = None) -> None:
        self.cfg, self.policy, self.progress = cfg, policy, progress
        self.beliefs = beliefs  # None: policies plan with the engines' true speeds
        self.first_token: dict[str, float] = {}  # request id -> when its first token came
        self.trajs = {s.id: Traj(s, i) for i, s in enumerate(specs)}
        self.live: dict[str, Traj] = {}  # arrived and not finished (what policies see)
        self.finished = 0
        self.groups: dict[str, GroupView] = {}
        self.instances: dict[str, Instance] = {}
        self.pending: dict[str, PendingCall] = {}
        self.ext: list[tuple[float, int, int, object]] = []
        self.steps: list[tuple[float, int, str]] = []
        self.outputs: dict[str, StepOutput] = {}
        self.req_owner: dict[str, str] = {}  # request id -> trajectory id (prewarm: "")
        self.relayouts: dict[int, tuple[Relayout, set[str]]] = {}
        self.now = self.start_s = start_s  # a later RL step continues the clock
        self.stats = SimStats()
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._snap: Snapshot | None = None
        self._revision = 0  # bumped by every change a scheduling pass reads
        self._last: PassKey | None = None  # what the last pass read (an equal one is skipped)
        self.bs = next(iter(cfg.profiles.values())).block_size
        self.weights = (None if cfg.weight_update_every_s is None else WeightUpdater(
            cfg.weight_update_every_s, cfg.weight_update_mode, cfg.weight_update_s,
            start_s + cfg.weight_update_every_s))
        # hooks of a driver that runs many batches on one clock (bench/simulator/loop.py)
        self.on_finish: Callable[[Traj], None] | None = None
        self.on_resume: Callable[[], None] | None = None

    # ------------------------------------------------------------------ setup
    def _start_instance(self, tp: int) -> Instance:
        cfg = self.cfg
        engine = EngineCore(cfg.profiles[tp], scheduling_policy="priority", seed=cfg.seed,
                            max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens)
        cap = cfg.max_num_seqs if cfg.cap_per_gpu is None else cfg.cap_per_gpu * tp
        inst = Instance(f"i{next(self._ids)}-tp{tp}", tp, engine, cap)
        self.instances[inst.id] = inst
        return inst

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.ext, (t, next(self._seq), kind, payload))

    def _next_id(self) -> int:
        return next(self._ids)

    def run(self) -> float:
        """Simulate until every trajectory finished; returns the time the last one ended
        (the makespan when ``start_s`` is 0)."""
        self.start()
        while self.finished < len(self.trajs):
            self._next_event()
        return max(t.finished_at or 0.0 for t in self.trajs.values())

    def start(self) -> None:
        """Start the policy's layout and the batch's first calls (:meth:`run` goes on)."""
        layout = self.policy.initial_layout(self.cfg.gpus)
        if sum(layout) != self.cfg.gpus:
            raise ValueError(f"layout {layout} does not use {self.cfg.gpus} GPUs")
        for tp in layout:
            self._start_instance(tp)
        for tr in self.trajs.values():
            self._push(self.start_s + tr.spec.setup_s, READY, tr)
        if self.policy.plan_interval_s:
            self._push(self.start_s + self.policy.plan_interval_s, PLAN, None)
        if self.weights is not None and math.isfinite(self.weights.next_due):
            self.push_pause(self.weights.next_due)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at simulated time ``t`` (a driver's own event: a trainer step)."""
        self._push(t, CALL, fn)

    def _next_event(self) -> None:
        if self.steps and (not self.ext or self.steps[0][0] <= self.ext[0][0]):
            t, _, iid = heapq.heappop(self.steps)
            self.now = t
            self._snap = None
            self._step_done(self.instances[iid])
            return
        t, _, kind, payload = heapq.heappop(self.ext)
        self.now = t
        self._snap = None
        if kind == READY:
            assert isinstance(payload, Traj)
            self._ready(payload)
        elif kind == FINISH:
            assert isinstance(payload, Traj)
            self._finish(payload)
            self._revision += 1
        elif kind == PLAN:
            self._plan()
            self._revision += 1
        elif kind in (PAUSE, RESUME):
            self._weight_event(kind)
        elif kind == CALL:
            assert callable(payload)
            payload()
            self._revision += 1
        else:  # UP: a relayout's new instances
            assert kind == UP
            assert isinstance(payload, tuple)
            for tp in payload:
                self._start_instance(tp)
            self._revision += 1
        self._schedule()

    # ------------------------------------------------------------------ snapshot
    def snapshot(self) -> Snapshot:
        if self._snap is None:
            self._snap = Snapshot(
                self.now, self.cfg.gpus, tuple(i.view() for i in self.instances.values()),
                LiveViews(self.live), self.groups,
                self.cfg.speeds if self.beliefs is None else self.beliefs.current(),
                self.cfg.restart_s,
                self.finished,
                borrowed=frozenset() if self.beliefs is None else self.beliefs.borrowed())
        return self._snap

    def _changed(self, tr: Traj) -> None:
        tr.touch()
        self._snap = None
        self._revision += 1

    # ------------------------------------------------------------------ trajectories
    def _ready(self, tr: Traj) -> None:
        """A call becomes ready: first call after setup, or the next after a tool gap."""
        if tr.turn == 0:
            tr.started_at = self.now
            self.live[tr.spec.id] = tr
            g = self.groups.get(tr.spec.group_id)
            self.groups[tr.spec.group_id] = (
                GroupView(tr.spec.group_id, (tr.spec.id,)) if g is None else
                GroupView(g.id, (*g.members, tr.spec.id), g.finished_lengths,
                          g.finished_turns))
        else:
            prev = tr.spec.turns[tr.turn - 1]
            tr.outcomes.append(prev.tool_state)
            tr.tool_s += prev.tool_s
        tr.phase = Phase.QUEUED
        tr.enqueued_at = self.now
        self.stats.call_times.append(self.now)
        self._changed(tr)
        self.policy.observe(tr.view(), self.groups, self.now)
        self._record_prediction(tr)
        key = f"{tr.spec.id}#{tr.turn}"
        self.pending[key] = PendingCall(key, tr.spec.id, tr.turn, tr.prompt_len(), self.now)

    def _record_prediction(self, tr: Traj) -> None:
        pred = self.policy.predict(tr.view(), self.snapshot())
        if pred is None:
            return
        self.stats.predictions.append((pred.mean, tr.remaining_output(tr.generated)))
        if tr.turn <= 2:
            self.stats.early[tr.spec.id] = tr.generated + pred.mean

    def _schedule(self) -> None:
        """One pass of the gateway's own step, skipped until something it reads changes
        (``_revision``: engine steps alone free no gateway slot, and re-sorting a long queue
        per step made large batches quadratic). Free slots are the instances' own: one a
        plan retires takes no call, even before the snapshot is rebuilt."""
        if not self.pending or (self.weights and self.weights.gate_closed):
            return
        free = {i.id: i.cap - i.running if i.state is InstanceState.UP else 0
                for i in self.instances.values()}
        done = schedule_pass(self.policy, self.snapshot(),
                             [Queued(c) for c in self.pending.values()], self.live,
                             revision=self._revision, last=self._last, free=free)
        self._last = done.key
        for f in done.failed:
            self._call_failed(self.trajs[self.pending.pop(f.call.key).trajectory_id])
        for d in done.placed:
            call = self.pending.pop(d.key)
            self._dispatch(self.trajs[call.trajectory_id], self.instances[d.instance],
                           d.priority)

    def _call_failed(self, tr: Traj) -> None:
        """The step failed this call (the policy raised on it): the harness gives up."""
        self.stats.failed_calls += 1
        tr.phase = Phase.TOOL
        tr.finished_at = self.now
        self._changed(tr)
        self._push(self.now + OVERHEAD_S, FINISH, tr)

    def _dispatch(self, tr: Traj, inst: Instance, priority: int) -> None:
        out = tr.spec.turns[tr.turn].output_tokens
        toks = tr.tokens(tr.prompt_len() + out)
        n = tr.prompt_len() + tr.partial  # a call a relayout moved goes on where it was
        hashes = tr.hashes_for(toks[:n], self.bs)
        rid = f"{tr.spec.id}#{tr.turn}" + (f"@{tr.partial}" if tr.partial else "")
        inst.engine.add_request(SimRequest(
            rid, toks[:n], out - tr.partial, ignore_eos=True,
            priority=priority, arrival=self.now, output_ids=toks[n:], prompt_hashes=hashes))
        self.req_owner[rid] = tr.spec.id
        tr.request = rid
        tr.queue_s += self.now - tr.enqueued_at
        tr.dispatched_at = self.now
        tr.instance = inst.id
        tr.phase = Phase.GENERATING
        self._changed(tr)
        inst.running += 1
        self.stats.calls += 1
        self._kick(inst)

    def _call_done(self, tr: Traj, inst: Instance) -> None:
        turn = tr.spec.turns[tr.turn]
        if self.beliefs is not None:
            if tr.partial:  # moved mid-call: no whole decode to measure
                self.first_token.pop(tr.request, None)
            else:
                self._measure(tr, inst, turn.output_tokens)
        tr.partial = 0
        tr.context = tr.prompt_len() + turn.output_tokens
        tr.generated += turn.output_tokens
        tr.llm_s += self.now - tr.dispatched_at
        tr.turn += 1
        inst.running -= 1
        inst.served += 1
        last = tr.turn == len(tr.spec.turns)
        # the gateway cannot tell a last call from any other: the trajectory is in its
        # tool gap until the client's /finish arrives
        tr.phase = Phase.TOOL
        self._changed(tr)
        self.policy.observe(tr.view(), self.groups, self.now)
        if last:
            tr.finished_at = self.now  # the rollout's own end (makespan)
            self._push(self.now + OVERHEAD_S, FINISH, tr)
        else:
            self._push(self.now + turn.tool_s + OVERHEAD_S, READY, tr)
        mig = self.policy.on_tool_gap(self.snapshot(), tr.view())
        if mig is not None:
            self._migrate(tr, mig.target)

    def _measure(self, tr: Traj, inst: Instance, tokens: int) -> None:
        """Report the call's decode as the gateway does for a stream: from its first token
        on, the instance's calls counted before this one leaves."""
        assert self.beliefs is not None
        first = self.first_token.pop(tr.request, None)
        if first is not None:
            self.beliefs.observe(inst.tp, self.now - first, tokens - 1, inst.running,
                                 tr.prompt_len() + tokens)

    def _finish(self, tr: Traj) -> None:
        """The client's /finish: now the gateway (and the policy) knows it is over."""
        tr.phase = Phase.FINISHED
        tr.touch()
        self._snap = None
        del self.live[tr.spec.id]
        self.finished += 1
        g = self.groups[tr.spec.group_id]
        self.groups[tr.spec.group_id] = GroupView(
            g.id, g.members, (*g.finished_lengths, tr.generated), (*g.finished_turns, tr.turn))
        self.policy.observe(tr.view(), self.groups, self.now)
        if self.progress is not None:
            self.progress(self.finished)
        if self.on_finish is not None:
            self.on_finish(tr)

    def _migrate(self, tr: Traj, target: str) -> None:
        """Prewarm ``target`` with the trajectory's context while its tool runs."""
        inst = self.instances.get(target)
        if inst is None or inst.state is not InstanceState.UP or tr.context < 2:
            return
        toks = tr.tokens(tr.context)
        rid = f"{tr.spec.id}#{tr.turn}:warm"
        inst.engine.add_request(SimRequest(
            rid, toks, 1, ignore_eos=True, priority=-2_000_000, arrival=self.now,
            prompt_hashes=tr.hashes_for(toks, self.bs)))
        self.req_owner[rid] = ""
        tr.instance = target
        self._changed(tr)
        self.stats.migrations += 1
        self._kick(inst)

    # ------------------------------------------------------------------ engines
    def _kick(self, inst: Instance) -> None:
        if inst.busy or not inst.engine.has_work or (self.weights and self.weights.engines_paused):
            return
        horizon = self.cfg.max_fuse_s
        if self.ext:
            horizon = min(horizon, max(0.0, self.ext[0][0] - self.now))
        out = inst.engine.step(horizon)
        self.stats.busy_gpu_s += out.duration_s * inst.tp
        inst.busy = True
        self.outputs[inst.id] = out
        heapq.heappush(self.steps, (self.now + out.duration_s, next(self._seq), inst.id))

    def _step_done(self, inst: Instance) -> None:
        inst.busy = False
        out = self.outputs.pop(inst.id)
        self.stats.preemptions += len(out.preempted)
        if self.beliefs is not None:
            for rid in out.first:
                if self.req_owner.get(rid):  # a prewarm's token is no call's
                    self.first_token[rid] = self.now
        if self.weights is not None:
            for rid, n in out.emitted.items():
                owner = self.req_owner[rid]
                if owner:
                    self.weights.record(owner, self.trajs[owner].turn, n)
        for rid, _ in out.finished:
            owner = self.req_owner.pop(rid)
            if owner:
                self._call_done(self.trajs[owner], inst)
        if inst.state is InstanceState.DRAINING:  # its calls finish, then it stops
            self._maybe_stopped(inst)
        if inst.id in self.instances:
            self._kick(inst)
        self._schedule()
        if inst.state is InstanceState.UP:
            self._kick(inst)
        if self.weights is not None:
            self.weights.check_idle(self)
