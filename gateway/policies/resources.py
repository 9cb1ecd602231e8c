"""How much and what TP: migration in tool gaps and pool-layout planners.

A running vLLM cannot change TP, so a layout change is drain + restart (Libra measures
~10.8 s to start; ``Snapshot.restart_s``). Every planner here proposes a change only
when the predicted gain beats that cost, and retires idle instances first so a drain
costs nothing but the restart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.policies.base import (
    InstanceView,
    Migrate,
    Phase,
    Prediction,
    Relayout,
    Snapshot,
    TrajectoryView,
)
from gateway.policies.dp import layout_makespan

TP_DEGREES = (1, 2, 4, 8)


def uniform_layout(gpus: int, tp: int) -> tuple[int, ...]:
    """``gpus // tp`` instances of TP ``tp``; leftover GPUs as TP1."""
    return (tp,) * (gpus // tp) + (1,) * (gpus % tp)


class GainMigrator:
    """Opportunistic migration (Heddle sec. 5.2) adapted to a gateway without KV transfer.

    Move during the tool gap only if ``remaining * (t_here - t_there)`` (decode time
    saved) exceeds ``margin`` times the re-prefill cost of the context on the target;
    the driver then prewarms the target (``max_tokens: 1``) while the tool runs. With
    ``locality`` (``progressive``), the cache at the current instance is also valued for the
    interference the re-prefill inflicts on the target's batch, so moves must pay more.
    """

    def __init__(self, margin: float = 1.0, locality: bool = False) -> None:
        self.margin = margin
        self.locality = locality

    def decide(self, snap: Snapshot, traj: TrajectoryView, pred: Prediction | None,
               target: str | None) -> Migrate | None:
        if pred is None or target is None or target == traj.instance:
            return None
        tgt = snap.instance(target)
        if tgt is None or tgt.free_slots <= 0 or tgt.tp not in snap.speeds:
            return None
        cur = snap.instance(traj.instance)
        if cur is None or not cur.up:
            return Migrate(traj.id, target)  # its cache is gone anyway: moving is free
        t_here = snap.speeds[cur.tp].step_s(cur.running)
        t_there = snap.speeds[tgt.tp].step_s(tgt.running + 1)
        gain = pred.mean * (t_here - t_there)
        cost = traj.context_tokens * snap.speeds[tgt.tp].prefill_s_per_token
        if self.locality:
            cost *= 1.0 + tgt.running * snap.speeds[tgt.tp].slope
        return Migrate(traj.id, target) if gain > self.margin * cost else None


class ContextBalancer:
    """Move a long trajectory, during its tool gap, off an instance crowded with context.

    A decode step reads every running sequence's KV cache, so on agentic workloads (tens
    of thousands of tokens of context each) an instance's step time follows the context
    it holds more than its sequence count (``TPSpeed.batch_step_s``). Sticky routing
    deals trajectories evenly by count, but a few long ones pile up context unevenly: at
    64 GPUs on search the tail's instances held 120k-580k tokens of context each, and
    their steps took 7.7-13.5 ms. Every observed quantity here is a counter the gateway
    has: each live trajectory's instance and context (tool gaps included: they return).

    The move pays when the decode time the trajectory saves over what it may still
    generate exceeds ``margin`` times what its re-prefill on the target costs. Without a
    prediction the generated tokens so far stand in for what remains (a heavy-tailed
    length has as much left, on average, as it has done). The engine runs the re-prefill
    in the steps of the calls decoding on the target (chunked prefill), so each of them
    waits it out as the mover does. Which call will set the makespan is not known; one
    whose trajectory holds at least the mover's context is as likely to set it as the
    mover, so the re-prefill is charged once for the mover and once for each such call
    running there. On a busy pool whose instances hold about the same context (tau at 16
    trajectories per GPU: some 20 running calls each, within 10% of each other) the
    moves charged to the mover alone went both ways, each instance sending as many as
    it received, and left the pool slower than no balancing at all. The other calls'
    context terms are not counted: the mover's context leaves one batch and joins the
    other, so what the source's calls save the target's roughly lose.
    """

    def __init__(self, margin: float = 2.0, min_context: int = 4096) -> None:
        self.margin = margin
        self.min_context = min_context
        self.exclude: frozenset[str] = frozenset()  # never a target (a straggler lane)
        self._loads: tuple[Snapshot, dict[str, tuple[int, int]]] | None = None

    def loads(self, snap: Snapshot) -> dict[str, tuple[int, int]]:
        """Up instance -> (live trajectories homed there, their context tokens)."""
        if self._loads is not None and self._loads[0] is snap:
            return self._loads[1]
        out = {i.id: (0, 0) for i in snap.instances if i.up}
        for t in snap.trajectories.values():
            if t.instance in out:
                n, c = out[t.instance]
                out[t.instance] = (n + 1, c + t.context_tokens)
        self._loads = (snap, out)
        return out

    @staticmethod
    def delayed(snap: Snapshot, instance: str, context: int) -> int:
        """Calls decoding on ``instance`` whose trajectories hold at least ``context``
        tokens: those a re-prefill there delays that may set the makespan."""
        return sum(1 for t in snap.trajectories.values()
                   if t.instance == instance and t.phase is Phase.GENERATING
                   and t.context_tokens >= context)

    def decide(self, snap: Snapshot, traj: TrajectoryView, pred: Prediction | None,
               target: str | None) -> Migrate | None:
        ctx = traj.context_tokens
        cur = snap.instance(traj.instance)
        if ctx < self.min_context or cur is None or not cur.up:
            return None
        loads = self.loads(snap)
        n0, c0 = loads[cur.id]
        here = snap.speeds[cur.tp].batch_step_s(n0, c0)
        best: tuple[float, str, int] | None = None  # step there, instance, its TP
        for inst in snap.instances:
            if (inst.id == cur.id or inst.id not in loads or inst.free_slots <= 0
                    or inst.id in self.exclude):
                continue
            n, c = loads[inst.id]
            there = snap.speeds[inst.tp].batch_step_s(n + 1, c + ctx)
            if best is None or there < best[0]:
                best = (there, inst.id, inst.tp)
        if best is None or best[0] >= here:
            return None
        remaining = pred.mean if pred is not None else traj.generated_tokens
        gain = remaining * (here - best[0])
        cost = ctx * snap.speeds[best[2]].prefill_s_per_token * (
            1 + self.delayed(snap, best[1], ctx))
        if gain <= self.margin * cost:
            return None
        # the move changes both loads: keep the cached table true for this snapshot
        loads[cur.id] = (n0 - 1, c0 - ctx)
        n, c = loads[best[1]]
        loads[best[1]] = (n + 1, c + ctx)
        return Migrate(traj.id, best[1])


class UniformPlanner:
    """One TP degree everywhere, never changed (the slime / verl baselines)."""

    def __init__(self, tp: int = 1, plan_interval_s: float | None = None) -> None:
        self.tp = tp
        self.plan_interval_s = plan_interval_s

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        return uniform_layout(gpus, self.tp)

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        return None


def idle_instances(snap: Snapshot, max_tp: int = 8) -> list[InstanceView]:
    """Up instances with nothing running and no live trajectory's cache, smallest first."""
    homes = {t.instance for t in snap.trajectories.values()}
    idle = [i for i in snap.instances
            if i.up and i.running == 0 and i.tp < max_tp and i.id not in homes]
    return sorted(idle, key=lambda i: (i.tp, i.id))


def pick_gpus(pool: Sequence[InstanceView], gpus: int) -> tuple[str, ...] | None:
    """Instances from ``pool`` (in order) whose GPUs sum to exactly ``gpus``."""
    chosen: list[str] = []
    total = 0
    for inst in pool:
        if total + inst.gpus <= gpus:
            chosen.append(inst.id)
            total += inst.gpus
        if total == gpus:
            return tuple(chosen)
    return None


class TailMergePlanner:
    """Heddle's adaptive TP manager (sec. 6), as a tail planner over a TP1 pool.

    When idle GPUs appear (the batch enters its tail), merge them into one higher-TP
    instance for the longest predicted trajectory if the decode time it saves,
    ``remaining * (t_now - t_new)``, beats twice the restart cost (restart plus the
    re-prefill and drain risk). The placer then migrates the trajectory there.
    """

    def __init__(self, base_tp: int = 1, plan_interval_s: float = 5.0) -> None:
        self.base_tp = base_tp
        self.plan_interval_s = plan_interval_s

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        return uniform_layout(gpus, self.base_tp)

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        if not preds:
            return None
        top = max(preds, key=lambda t: (preds[t].mean, t))
        cur = snap.instance(snap.trajectories[top].instance)
        if cur is None:
            return None
        t_now = snap.speeds[cur.tp].step_s(max(1, cur.running))
        idle = idle_instances(snap)
        for tp in (8, 4, 2):
            if tp <= cur.tp or tp not in snap.speeds:
                continue
            retire = pick_gpus([i for i in idle if i.tp < tp], tp)  # a merge, not a swap
            gain = preds[top].mean * (t_now - snap.speeds[tp].step_s(1))
            if retire is not None and gain > 2 * snap.restart_s:
                return Relayout(retire, (tp,), f"tail: {top} saves {gain:.0f}s")
        return None


def layout_of(snap: Snapshot) -> list[int]:
    return [i.tp for i in snap.instances if i.placed]


class JointPlanner:
    """``progressive``'s planner: TP layout chosen jointly with the presorted-DP placement.

    Candidates are the current layout and single moves from it (merge idle instances into
    one of TP 2/4/8, or split an idle high-TP instance into TP1s). Each is scored by the
    DP makespan of the live predictions (:func:`layout_makespan`), the same model the
    placer uses, so placement and layout agree; a move is applied only if it saves more
    than ``min_gain`` of the predicted makespan *and* more than the restart cost. In the
    tail (few trajectories) the DP favours high TP on its own: this is the end-of-batch
    GPU concentration; the explicit straggler rule of :class:`TailMergePlanner` runs
    first because the DP scores token time only and under-values a lone straggler.
    """

    def __init__(self, initial: Mapping[int, float], plan_interval_s: float = 5.0,
                 min_gain: float = 0.05) -> None:
        self.initial = dict(initial)  # tp -> fraction of GPUs
        self.plan_interval_s = plan_interval_s
        self.min_gain = min_gain
        self._tail = TailMergePlanner(plan_interval_s=plan_interval_s)

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        return mixed_layout(gpus, self.initial)

    def plan(self, snap: Snapshot, preds: Mapping[str, Prediction]) -> Relayout | None:
        if not preds:
            return None
        tail = self._tail.plan(snap, preds)  # the straggler rule first (end of batch)
        if tail is not None:
            return tail
        lengths = sorted((p.mean for p in preds.values()), reverse=True)
        current = layout_of(snap)
        base = layout_makespan(lengths, current, snap.speeds)
        best: tuple[float, Relayout] | None = None
        for move in self._moves(snap):
            layout = list(current)
            for iid in move.retire:
                inst = snap.instance(iid)
                if inst is not None:
                    layout.remove(inst.tp)
            layout.extend(move.launch)
            score = layout_makespan(lengths, layout, snap.speeds) + snap.restart_s
            if best is None or score < best[0]:
                best = (score, move)
        if best is not None and base - best[0] > self.min_gain * base:
            return best[1]
        return None

    def _moves(self, snap: Snapshot) -> list[Relayout]:
        idle = idle_instances(snap, max_tp=16)
        small = [i for i in idle if i.tp < 8]
        moves: list[Relayout] = []
        for tp in (2, 4, 8):
            if tp in snap.speeds:
                retire = pick_gpus(small, tp)
                if retire is not None and len(retire) > 1:
                    moves.append(Relayout(retire, (tp,), f"merge into TP{tp}"))
        for inst in idle:
            if inst.tp > 1:
                moves.append(Relayout((inst.id,), (1,) * inst.gpus, f"split TP{inst.tp}"))
        return moves


def mixed_layout(gpus: int, fractions: Mapping[int, float]) -> tuple[int, ...]:
    """Instances per TP from GPU fractions (largest TP first); the rest as TP1."""
    out: list[int] = []
    left = gpus
    for tp in sorted(fractions, reverse=True):
        if tp == 1:
            continue
        n = int(gpus * fractions[tp]) // tp
        n = min(n, left // tp)
        out += [tp] * n
        left -= n * tp
    return tuple(out + [1] * left)
