"""Weight updates in the simulator: what a pause mode costs in makespan and staleness.

Every ``every_s`` seconds of simulated time (counted from the batch's start) the trainer
has new weights, and the gateway runs the cycle of docs/weight-updates.md on every engine
of the pool at once. The gateway's gate closes at the pause: calls that become ready
wait in its queue until the resume.

* ``wait``: calls in flight run to their end (drain); then the update takes
  ``update_s`` with the engines idle; then resume.
* ``keep``: the engines freeze in-flight requests after the step that is running; the
  update takes ``update_s``; on resume each frozen request recomputes its context
  (prompt + tokens so far) before it decodes on. That re-prefill is an assumption taken
  from our reading of vLLM's keep mode (KV computed by the old weights is not reused).
* ``abort-and-continue``: the same freeze, but the requests are aborted (KV freed) and
  on resume the gateway sends each to the same engine again as prompt + tokens so far
  with the remaining output: the same re-prefill, paid as a new request.

In every mode the engines' prefix caches are reset at the update (the job's
``/reset_prefix_cache``): a trajectory's next call after an update prefills its whole
context again. If the next update is due before the previous one resumed (a long
drain), it starts at that resume.

Versions start at 0 and go up by one at each resume. Every generated token is tagged
with the version of the step that produced it (no step spans an update: the engines are
idle during one). A trajectory's *staleness* is its newest token version minus its
oldest: how many versions behind the weights at its end its oldest token is (what
``/trajectories/{id}/sample`` reports as ``max_staleness`` when asked at the
trajectory's end). A token is *stale* when it is older than its trajectory's newest. A
*spanning call* has tokens of more than one version; ``wait`` never makes one, but a
trajectory can still span versions across its calls under ``wait``.

``update_s`` defaults to 5 s, an assumption, not a measurement: Qwen3-14B is about 28 GB
in bf16; broadcasting it to the engines at an effective ~10 GB/s is about 3 s, plus
pause, resume and cache reset.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from backends.sim.request import SimRequest
from bench.simulator.state import Instance, Traj

MODES = ("wait", "keep", "abort-and-continue")
DEFAULT_UPDATE_S = 5.0


class Simulator(Protocol):
    """What the update cycle uses of :class:`bench.simulator.des.Simulator`."""

    now: float
    bs: int
    instances: dict[str, Instance]
    trajs: dict[str, Traj]
    req_owner: dict[str, str]

    def push_pause(self, t: float) -> None: ...

    def relayout_at_pause(self) -> None: ...

    def push_resume(self, t: float) -> None: ...


def check_schedule(every_s: float | None, mode: str, update_s: float) -> None:
    """ValueError unless the schedule makes sense (``every_s`` None: no updates)."""
    if mode not in MODES:
        raise ValueError(f"weight update mode must be one of {', '.join(MODES)}, not {mode!r}")
    if (every_s is not None and every_s <= 0) or update_s < 0:
        raise ValueError("weight updates need an interval > 0 s and an update time >= 0 s")


@dataclass(slots=True)
class WeightStats:
    updates: int = 0  # completed updates (resumes) before the batch ended
    paused_s: float = 0.0  # gate closed, pause to resume, summed
    drain_s: float = 0.0  # pause to every engine idle, summed
    resubmitted: int = 0  # running requests recomputed (keep), calls resubmitted (abort)


@dataclass(slots=True)
class _Held:
    owner: str
    instance: str
    generated: int  # by the whole call so far (every earlier continuation included)
    priority: int


@dataclass(slots=True)
class WeightUpdater:
    """The update cycle's state inside one :class:`~bench.simulator.des.Simulator`."""

    every_s: float
    mode: str
    update_s: float
    next_due: float
    version: int = 0
    gate_closed: bool = False  # the gateway dispatches nothing
    engines_paused: bool = False  # engines take no step
    frozen: bool = False  # engines idle and paused, the resume scheduled
    paused_at: float = 0.0
    stats: WeightStats = field(default_factory=WeightStats)
    held: list[_Held] = field(default_factory=list)
    #: trajectory id -> version -> tokens; (trajectory id, turn) -> versions of that call
    tokens: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    calls: dict[tuple[str, int], set[int]] = field(default_factory=lambda: defaultdict(set))

    def __post_init__(self) -> None:
        check_schedule(self.every_s, self.mode, self.update_s)

    # ------------------------------------------------------------------ tokens
    def record(self, owner: str, turn: int, n: int) -> None:
        per = self.tokens[owner]
        per[self.version] = per.get(self.version, 0) + n
        self.calls[(owner, turn)].add(self.version)

    def holds(self, instance: str) -> bool:
        return any(h.instance == instance for h in self.held)

    # ------------------------------------------------------------------ cycle
    def pause(self, sim: Simulator) -> None:
        self.gate_closed = True
        self.paused_at = sim.now
        if self.mode != "wait":
            self.engines_paused = True
        self.check_idle(sim)

    def check_idle(self, sim: Simulator) -> None:
        """Once every engine is idle (drained, for ``wait``): freeze the engines, abort or
        release what they hold, reset their caches and schedule the resume."""
        if not self.gate_closed or self.frozen:
            return
        insts = list(sim.instances.values())
        if any(i.busy for i in insts):
            return
        if self.mode == "wait" and any(i.engine.has_work for i in insts):
            return
        self.frozen = self.engines_paused = True
        self.stats.drain_s += sim.now - self.paused_at
        for inst in insts:
            if self.mode == "keep":
                self.stats.resubmitted += inst.engine.recompute_all()
            elif self.mode == "abort-and-continue":
                self._abort(sim, inst.id)
            inst.engine.kv.reset_prefix_cache()
        sim.relayout_at_pause()
        sim.push_resume(sim.now + self.update_s)

    def _abort(self, sim: Simulator, iid: str) -> None:
        engine = sim.instances[iid].engine
        for req, generated in engine.live_requests():
            engine.abort(req.id)
            owner = sim.req_owner.pop(req.id)
            if owner:  # prewarms are dropped, calls continued at the resume
                # a continuation's prompt already holds what the call generated before
                done = len(req.prompt_ids) - sim.trajs[owner].prompt_len() + generated
                self.held.append(_Held(owner, iid, done, req.priority))

    def resume(self, sim: Simulator) -> None:
        self.version += 1
        self.stats.updates += 1
        self.stats.paused_s += sim.now - self.paused_at
        self.gate_closed = self.engines_paused = self.frozen = False
        held, self.held = self.held, []
        for h in held:
            self._continue(sim, h)
        self.next_due += self.every_s
        if math.isfinite(self.next_due):  # inf: a driver pauses on demand (loop.py)
            sim.push_pause(max(self.next_due, sim.now))

    def _continue(self, sim: Simulator, h: _Held) -> None:
        tr = sim.trajs[h.owner]
        inst = sim.instances[h.instance]
        n, out = tr.prompt_len(), tr.spec.turns[tr.turn].output_tokens
        toks = tr.tokens(n + out)
        p = n + h.generated
        rid = f"{h.owner}#{tr.turn}+v{self.version}"
        inst.engine.add_request(SimRequest(
            rid, toks[:p], out - h.generated, ignore_eos=True, priority=h.priority,
            arrival=sim.now, output_ids=toks[p:], prompt_hashes=tr.hashes_for(toks[:p], sim.bs)))
        sim.req_owner[rid] = h.owner
        self.stats.resubmitted += 1

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, float]:
        """Updates, paused time and staleness of the batch (see the module docstring)."""
        stale = total = 0
        per_traj: list[int] = []
        for versions in self.tokens.values():
            newest = max(versions)
            per_traj.append(newest - min(versions))
            total += sum(versions.values())
            stale += sum(n for v, n in versions.items() if v < newest)
        return {
            "updates": self.stats.updates, "paused_s": self.stats.paused_s,
            "drain_s": self.stats.drain_s, "resubmitted": self.stats.resubmitted,
            "mean_staleness": sum(per_traj) / len(per_traj) if per_traj else 0.0,
            "max_staleness": max(per_traj, default=0),
            "stale_token_frac": stale / total if total else 0.0,
            "spanning_calls": sum(len(v) > 1 for v in self.calls.values()),
        }
