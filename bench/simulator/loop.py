"""RL loops past the synchronous barrier: step modes, a trainer, samples per hour.

``bench steps`` simulates rollout batches behind a barrier. Here the trainer is in the
loop too (``train_s`` per optimizer step, then ``push_s`` with the engines paused while
the new weights load), and the trainer chooses how a step's samples are gathered
(docs/step-modes.md):

* ``sync``: start B groups, wait for all of them, train, push, repeat. Every token is
  on-policy; the pool idles while the trainer works and while the batch's tail finishes.
* ``overprovisioned`` (APRIL, arXiv 2509.18521): keep ``ceil(B*(1+over))`` groups going,
  train on the first B groups to complete; the unfinished ones are *carried* across the
  update (paused in the engines, continued on the new weights: their older tokens are one
  version stale) or *dropped*. The pool pauses while the trainer trains, as in APRIL.
* ``async`` (AReaL, arXiv 2505.24298; verl's fully asynchronous trainer): rollouts never
  stop but for the push. The trainer takes B complete groups whenever it is free; new
  groups start while at most ``(version + max_staleness + 1) * B`` have been started
  (AReaL's admission rule).
* ``tail-batching`` (RollPacker, arXiv 2509.21009): short rounds start ``ceil(B*(1+over))``
  groups and train on the first B to complete; the prompts still running are aborted and
  deferred, and once B prompts are deferred they run together in a long round (fresh
  samples, no abort). Every token is on-policy; long prompts are trained in rounds of
  their own, which changes the order the model sees them in.

*Staleness* of a trained token is the trainer's version when it takes the sample minus
the version that generated the token (0: on-policy). ``max_staleness`` bounds it: at each
push, a trajectory whose oldest token could no longer be trained within the bound is
restarted from its first call (``on_stale="restart"``, the same task sampled again) or its
group is dropped (``"drop"``). Tokens of aborted, dropped and restarted work are *wasted*.
A group is complete when the client's ``/finish`` of its last member arrives.

The groups come from one stream per seed (``bench.simulator.steps.generate_step`` round
after round), so every mode meets the same prompts in the same order. Policies are the
gateway's own objects and see only what a live gateway sees.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from bench.simulator.des import SimConfig
from bench.simulator.loop_run import LoopRun, LoopScenario
from bench.simulator.loop_sim import LoopSim
from bench.simulator.speeds import band_profiles, live_beliefs, max_tp_for, speeds
from bench.simulator.state import Traj
from bench.simulator.steps import generate_step
from bench.workloads import TrajectorySpec, load_workloads, prompt_group
from gateway.policies.registry import ORACLE_NAMES, get_policy, resolve_name


@dataclass(slots=True)
class Group:
    gid: str
    prompt_index: int
    members: list[str]  # current attempt of each member
    need: int  # members that complete the group (fewer than started: tail-batching)
    done: list[str] = field(default_factory=list)
    completed_at: float | None = None


def group_stream(sc: LoopScenario) -> Iterator[list[TrajectorySpec]]:
    """Groups of the seed's RL run, round after round (``bench steps``' draws), with ids
    made unique per round (``r3/g12``)."""
    k = 0
    while True:
        specs = generate_step(sc.workload, sc.seed, k, prompts=sc.prompts,
                              group_size=sc.group_size, pool_factor=sc.pool_factor)
        by: dict[str, list[TrajectorySpec]] = {}
        for s in specs:
            by.setdefault(s.group_id, []).append(
                replace(s, id=f"r{k}/{s.id}", group_id=f"r{k}/{s.group_id}"))
        yield from by.values()
        k += 1


PAUSE_MODE = {"sync": "wait", "overprovisioned": "keep", "async": "keep",
              "tail-batching": "wait"}


class Loop:
    """One run: the trainer, the step mode, and the simulator they drive."""

    def __init__(self, sc: LoopScenario) -> None:
        sc.check()
        self.sc = sc
        w = load_workloads()[sc.workload]
        self.size = sc.group_size or w["group_size"]
        self.batch = sc.prompts or w["prompts"]
        profs = band_profiles(sc.model, sc.gpu, sc.tp_efficiency, max_tp_for(sc.gpus),
                              sc.memory)
        # the engines stay paused through the training itself unless rollouts overlap it
        pause_s = sc.push_s + (0.0 if sc.mode == "async" else sc.train_s)
        mode = "wait" if sc.mode == "overprovisioned" and not sc.carry else PAUSE_MODE[sc.mode]
        cfg = SimConfig(sc.gpus, profs, speeds(profs), seed=sc.seed,
                        weight_update_every_s=math.inf, weight_update_mode=mode,
                        weight_update_s=pause_s)
        truth: dict[str, int] = {}
        oracle = ((lambda tid, gen: truth[tid] - gen)
                  if resolve_name(sc.policy) in ORACLE_NAMES else None)
        self.truth = truth
        self.sim = LoopSim(get_policy(sc.policy, seed=sc.seed, oracle_truth=oracle), cfg,
                           live_beliefs(sc.model, sc.gpu, sc.gpus, sc.beliefs, sc.memory))
        self.sim.on_finish = self._finished
        self.sim.on_resume = self._resumed
        self.stream = group_stream(sc)
        self.groups: dict[str, Group] = {}
        self.member_of: dict[str, str] = {}
        self.buffer: deque[str] = deque()  # complete, not yet trained
        self.deferred: deque[int] = deque()  # tail-batching: prompt indexes
        self.started = 0  # groups started (async admission)
        self.training = False
        self.long_round = False
        self.round_start = 0.0
        self.attempts: Counter[str] = Counter()
        #: the weight version each trajectory started on: staleness counts from there,
        #: as the gateway judges it, so one still queued with no token is judged too
        self.born: dict[str, int] = {}
        self.run_ = LoopRun(sc)

    def _version(self) -> int:
        assert self.sim.weights is not None
        return self.sim.weights.version

    # ---------------------------------------------------------------- groups
    def _start(self, specs: list[TrajectorySpec], prompt_index: int) -> None:
        gid = specs[0].group_id
        if gid in self.groups:  # a deferred prompt run again: a new group id
            gid = f"{gid}~{self.attempts[gid]}"
            self.attempts[specs[0].group_id] += 1
            specs = [replace(s, id=f"{gid}/{s.id.rsplit('/', 1)[-1]}", group_id=gid)
                     for s in specs]
        self.groups[gid] = Group(gid, prompt_index, [s.id for s in specs], self.size)
        for s in specs:
            self.member_of[s.id] = gid
            self.born[s.id] = self._version()
            self.truth[s.id] = s.total_output
            self.run_.drawn_output += s.total_output
            self.run_.drawn_count += 1
        self.started += 1
        self.sim.add(specs)

    def _start_next(self, n: int) -> None:
        """The stream's next ``n`` groups (tail-batching's short rounds: each with
        ``over_members`` extra samples, fresh draws of the same prompt)."""
        extra = 0
        if self.sc.mode == "tail-batching":
            extra = math.ceil(self.size * (1 + self.sc.over_members)) - self.size
        for _ in range(n):
            specs = next(self.stream)
            p = specs[0].prompt_index
            if extra:
                more = self._redraw(p)[:extra]
                specs = specs + [replace(s, id=f"{specs[0].group_id}/x{m}-{s.id}",
                                         group_id=specs[0].group_id)
                                 for m, s in enumerate(more)]
            self._start(specs, p)

    def _redraw(self, p: int) -> list[TrajectorySpec]:
        """Fresh samples of prompt ``p`` (the same task: ``prompt_group``'s task draws)."""
        sc = self.sc
        w = load_workloads()[sc.workload]
        tag = f"d{self.attempts[f'p{p}']}"
        self.attempts[f"p{p}"] += 1
        specs = prompt_group(sc.workload, w, p, size=self.size,
                             task=random.Random(f"{sc.seed}:{sc.workload}:{p}"),
                             samples=random.Random(f"{sc.seed}:{sc.workload}:{p}:{tag}"))
        return [replace(s, id=f"{tag}/{s.id}", group_id=f"{tag}/{s.group_id}") for s in specs]

    def _tokens(self, tid: str) -> dict[int, int]:
        assert self.sim.weights is not None
        return self.sim.weights.tokens.get(tid, {})

    def _waste(self, tid: str) -> None:
        self.run_.wasted_tokens += sum(self._tokens(tid).values())
        self.sim.drop(tid)

    def _drop_group(self, gid: str) -> None:
        g = self.groups.pop(gid)
        for tid in g.members:
            self._waste(tid)
        if gid in self.buffer:
            self.buffer.remove(gid)
        self.run_.dropped_groups += 1

    def _restart(self, gid: str, tid: str) -> None:
        """Run member ``tid`` again from its first call: a fresh sample of its prompt."""
        g = self.groups[gid]
        self._waste(tid)
        spec = self.sim.trajs[tid].spec
        member = int(spec.id.split("~")[0].rsplit("-m", 1)[1])
        fresh = self._redraw(spec.prompt_index)[member]
        base = spec.id.split("~")[0]  # each run of a member gets an id of its own: a reused
        self.attempts[base] += 1  # one would inherit the old run's token ledger
        new = replace(fresh, id=f"{base}~{self.attempts[base]}", group_id=gid)
        g.members[g.members.index(tid)] = new.id
        if tid in g.done:
            g.done.remove(tid)
        g.completed_at = None
        if gid in self.buffer:
            self.buffer.remove(gid)
        self.member_of[new.id] = gid
        self.born[new.id] = self._version()
        self.truth[new.id] = new.total_output
        self.run_.restarts += 1
        self.sim.add([new])

    # ---------------------------------------------------------------- events
    def _finished(self, tr: Traj) -> None:
        gid = self.member_of.get(tr.spec.id)
        g = self.groups.get(gid or "")
        if g is None or tr.spec.id not in g.members:
            return
        g.done.append(tr.spec.id)
        if len(g.done) == g.need:  # the extra samples still running are cut
            for tid in g.members:
                if tid not in g.done:
                    self._waste(tid)
            g.completed_at = self.sim.now
            self.buffer.append(g.gid)
            self._maybe_train()

    def _maybe_train(self) -> None:
        if (self.training or len(self.buffer) < self.batch
                or len(self.run_.samples) >= self.sc.steps):
            return
        barrier = self.sc.mode == "sync" or self.long_round
        if barrier and any(g.completed_at is None for g in self.groups.values()):
            return  # behind the barrier: every group of the round
        if self._set_aside_stale() and len(self.buffer) < self.batch:
            return
        take = [self.buffer.popleft() for _ in range(self.batch)]
        self._train(take)

    def _train(self, take: list[str]) -> None:
        """The trainer takes ``take``: stamp staleness, then the mode's cut of the round."""
        version, run, trained = self._version(), self.run_, 0
        for gid in take:
            g = self.groups.pop(gid)
            for tid in g.done:
                for v, n in self._tokens(tid).items():
                    run.lag_tokens[version - v] += n
                trained += self.sim.trajs[tid].spec.total_output
        run.trained_output += trained
        run.trained_tokens.append(trained)
        run.samples.append(len(take) * self.size)
        self.training = True
        mode = self.sc.mode
        if mode == "sync" or self.long_round:
            run.rollout_s.append(self.sim.now - self.round_start)
        if mode == "tail-batching" and not self.long_round:
            for gid in list(self.groups):  # the round's tail, deferred to a long round
                self.deferred.append(self.groups[gid].prompt_index)
                self._drop_group(gid)
                self.run_.dropped_groups -= 1  # deferred, not lost
        if mode == "overprovisioned" and not self.sc.carry:
            for gid in list(self.groups):  # what the step did not take: on-policy or nothing
                self._drop_group(gid)
        if mode == "async":  # rollouts go on while the trainer trains
            self.sim.at(self.sim.now + self.sc.train_s, self._push)
        else:
            self._push()

    def _push(self) -> None:
        assert self.sim.weights is not None
        self.sim.weights.pause(self.sim)

    def _resumed(self) -> None:
        """The new weights are in: enforce the staleness bound, start what the mode starts."""
        self.training = False
        self.run_.train_ends.append(self.sim.now)
        self.run_.busy_at_end.append(self.sim.stats.busy_gpu_s)
        self.sim.hold(0)
        self.run_.sandbox_s_at_end.append(self.sim.sandbox_s)
        self.run_.sandbox_peaks.append(self.sim.sandbox_peak)
        self.sim.sandbox_peak = self.sim.sandboxes
        if self.sc.mode in ("overprovisioned", "async"):
            self._enforce_staleness(self._version())
        if len(self.run_.train_ends) < self.sc.steps:
            self._next_round()
        self._maybe_train()

    def _enforce_staleness(self, version: int) -> None:
        """The gateway's rule at a version change: a live trajectory that started more
        than the bound behind is stopped (restarted, or its group dropped)."""
        bound = self.sc.max_staleness
        for gid, g in list(self.groups.items()):
            if gid in self.buffer:
                continue  # complete: the trainer's to judge (_set_aside_stale)
            late = [t for t in g.members if t not in g.done and version - self.born[t] > bound]
            self._stale(gid, late)

    def _set_aside_stale(self) -> bool:
        """The trainer's rule (StepRunner): a complete group that waited until a member's
        tokens are more than the bound behind is not trained; those members run again (or
        the group is dropped). Whether any was set aside."""
        bound = self.sc.max_staleness
        if self.sc.mode not in ("overprovisioned", "async"):
            return False
        version, any_ = self._version(), False
        for gid in list(self.buffer):
            g = self.groups[gid]
            late = [t for t in g.done if any(version - v > bound for v in self._tokens(t))]
            any_ = self._stale(gid, late) or any_
        return any_

    def _stale(self, gid: str, late: list[str]) -> bool:
        if not late:
            return False
        if self.sc.on_stale == "drop":
            self._drop_group(gid)
        else:
            for tid in late:
                self._restart(gid, tid)
        return True

    def _next_round(self) -> None:
        mode, b = self.sc.mode, self.batch
        self.round_start = self.sim.now
        extra = math.ceil(b * (1 + self.sc.over))
        if mode == "sync":
            self._start_next(b)
        elif mode == "overprovisioned":
            self._start_next(max(0, extra - len(self.groups)))
        elif mode == "async":
            room = (self._version() + self.sc.max_staleness + 1) * b
            self._start_next(max(0, room - self.started))
        else:
            self.long_round = len(self.deferred) >= b
            if self.long_round:
                for _ in range(b):
                    p = self.deferred.popleft()
                    self._start(self._redraw(p), p)
            else:
                self._start_next(extra)

    def run(self) -> LoopRun:
        self.sim.start()
        self._next_round()
        self.sim.run_until(lambda: len(self.run_.train_ends) >= self.sc.steps)
        assert self.sim.weights is not None
        self.run_.generated_tokens = sum(
            sum(v.values()) for v in self.sim.weights.tokens.values())
        return self.run_


def run_loop(sc: LoopScenario) -> LoopRun:
    """One seed of one mode (a module-level function: process pools pickle it)."""
    return Loop(sc).run()
