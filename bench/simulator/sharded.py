"""Shards on one clock: what the front's rebalancer does to a batch's makespan.

A sharded gateway runs one scheduler per shard over its own GPUs (docs/scaling.md). Here
each shard is a :class:`~bench.simulator.des.Simulator` of its own (its policy object, its
engines, its part of the batch), and :func:`run_shards` drives them event by event in
time order on one clock. With :class:`Rebalancing`, every ``interval_s`` it reads each
shard's calls running or queued and its ready instances, smooths them as the front does,
and asks the front's own rule (:func:`gateway.shards.rebalance.choose`, the code the live
rebalancer runs) for a move. A move is what the live one costs: the instance drains on
its shard (no new calls; those in its engine finish), its GPUs leave that shard, and
``restart_s`` later (an engine start) an instance of the same TP comes up on the other
shard. One move at a time, and ``cooldown_s`` after one ends before the next look counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bench.simulator.des import Simulator
from gateway.config import ShardSettings
from gateway.policies.base import InstanceState, Relayout
from gateway.shards.rebalance import Engine, ShardLoad, choose, smooth

_LIVE = ShardSettings()


@dataclass(slots=True)
class Rebalancing:
    """The front's settings (gateway/config.py ``ShardSettings``, whose defaults these
    are), in simulated time."""

    interval_s: float = 10.0  # the live default is 0 (off): this is a look every 10 s
    ratio: float = _LIVE.rebalance_ratio
    min_calls: float = float(_LIVE.rebalance_min_calls)
    cooldown_s: float = _LIVE.rebalance_cooldown_s


@dataclass(slots=True)
class _Move:
    giver: int
    instance: str
    taker: int
    tp: int
    at: float
    drained_at: float | None = None
    up_at: float | None = None
    landed: bool = False


@dataclass(slots=True)
class _State:
    calls: list[float | None]
    moves: list[_Move] = field(default_factory=list)
    next_look: float = 0.0

    @property
    def moving(self) -> _Move | None:
        return self.moves[-1] if self.moves and self.moves[-1].drained_at is None else None


def _next_time(sim: Simulator) -> float:
    t = math.inf
    if sim.steps:
        t = sim.steps[0][0]
    if sim.ext:
        t = min(t, sim.ext[0][0])
    return t


def _done(sim: Simulator) -> bool:
    return sim.finished >= len(sim.trajs)


def run_shards(sims: list[Simulator], rebalancing: Rebalancing | None = None
               ) -> dict[str, Any]:
    """Run every shard's batch to its end; the makespan (the last shard's end), each
    shard's, and the moves made (each: from, to, TP, when asked, drained, up)."""
    for sim in sims:
        sim.start()
    state = _State([None] * len(sims),
                   next_look=rebalancing.interval_s if rebalancing else math.inf)
    while not all(_done(s) for s in sims):
        live = [(_next_time(s), i) for i, s in enumerate(sims) if not _done(s)]
        t, k = min(live)
        if math.isinf(t):
            raise RuntimeError(f"shard {k} has trajectories left and nothing to run them")
        if rebalancing is not None and state.next_look <= t:
            _look(sims, state, rebalancing, state.next_look)
            state.next_look += rebalancing.interval_s
            continue
        sims[k]._next_event()
        if (move := state.moving) is not None and k == move.giver:
            _maybe_drained(sims, move)
    ends = [max((tr.finished_at or 0.0 for tr in s.trajs.values()), default=0.0)
            for s in sims]
    for m in state.moves:  # the taker's batch ended before the engine came up
        m.landed = m.up_at is not None and m.up_at <= ends[m.taker]
    return {"makespan_s": max(ends), "shard_makespans_s": ends,
            "moves": [{"from": m.giver, "to": m.taker, "tp": m.tp, "at": round(m.at, 1),
                       "drained_at": m.drained_at and round(m.drained_at, 1),
                       "up_at": m.up_at and round(m.up_at, 1), "landed": m.landed}
                      for m in state.moves]}


def _look(sims: list[Simulator], state: _State, rb: Rebalancing, now: float) -> None:
    loads = []
    for i, sim in enumerate(sims):
        up = [inst for inst in sim.instances.values() if inst.state is InstanceState.UP]
        # in flight on every engine (draining ones too) and queued, as /status counts them
        calls = float(sum(inst.running for inst in sim.instances.values()) + len(sim.pending))
        # a shard whose batch ended takes no engine
        state.calls[i] = 0.0 if _done(sim) else smooth(state.calls[i], calls)
        engines = tuple(Engine(inst.id, inst.tp, inst.running, inst.relayout is None)
                        for inst in up)
        loads.append(ShardLoad(i, sum(inst.tp for inst in up), state.calls[i] or 0.0,
                               engines))
    if state.moving is not None:
        return
    last = state.moves[-1].up_at if state.moves else None
    if last is not None and now < last + rb.cooldown_s:
        return
    move = choose(loads, rb.ratio, rb.min_calls)
    if move is None:
        return
    giver = sims[move.shard]
    inst = giver.instances[move.backend]
    giver.now = max(giver.now, now)  # every shard's next event is at `now` or later
    rid = giver._next_id()
    giver.relayouts[rid] = (Relayout((inst.id,), ()), {inst.id})
    inst.state, inst.relayout = InstanceState.DRAINING, rid
    giver.cfg.gpus -= inst.tp
    giver._snap = None
    giver._revision += 1
    state.moves.append(_Move(move.shard, inst.id, move.to, inst.tp, now))
    giver._maybe_stopped(inst)
    _maybe_drained(sims, state.moves[-1])


def _maybe_drained(sims: list[Simulator], move: _Move) -> None:
    """Once the moving instance left its shard, start its like on the other after an
    engine start."""
    giver, taker = sims[move.giver], sims[move.taker]
    if move.instance in giver.instances:
        return
    move.drained_at = giver.now
    move.up_at = giver.now + taker.cfg.restart_s

    def up() -> None:
        taker._start_instance(move.tp)
        taker.cfg.gpus += move.tp
        taker._snap = None

    taker.at(move.up_at, up)
