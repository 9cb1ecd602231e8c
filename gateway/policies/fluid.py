"""The fluid model :class:`~gateway.policies.replay.ReplayPlanner` ranks layouts with.

:class:`StepRecorder` keeps what the gateway observed of each trajectory (its turns: new
prompt tokens, generated tokens, the tool time before each call); :func:`replay_makespan`
replays those trajectories on a layout: a fluid model of vLLM's continuous batching on
verl's routing (sticky, new trajectories round robin). On each instance the sequences
decoding at once share its steps, a step costs ``fixed + seq*n + ctx*C`` (the speeds'
batch model, with ``C`` the context they hold), prefill of new prompt tokens delays the
instance's decoding, KV room and ``max_num_seqs`` throttle an instance that holds more
than fits, and a trajectory waits out its tool time between calls. It is an estimate for
ranking layouts (a few tens of milliseconds for a 256-trajectory step), not the
simulator. :func:`probe_layout` is the first step's layout, which measures every degree.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.policies.base import Phase, TPSpeed, TrajectoryView

#: the engine's ``max_num_seqs`` the replay assumes (vLLM's default for a GPU)
MAX_NUM_SEQS = 256
@dataclass(frozen=True, slots=True)
class Turn:
    """One observed LLM call of a trajectory."""

    new_tokens: int  # prompt tokens beyond the last call's context (the tool's output)
    output_tokens: int
    tool_s: float  # tool time between the last call and this one


@dataclass(slots=True)
class _Seen:
    order: int  # when the gateway first saw it (verl's routing is by arrival)
    prompt: str  # its first prompt's identity (a GRPO group's members share it)
    turns: list[Turn] = field(default_factory=list)
    context: int = 0
    tool_s: float = 0.0


#: finished trajectories a step's sample keeps: a gateway whose rollouts never pause (an
#: asynchronous step mode, a steady stream of calls) never closes a step, and its sample
#: is then the latest this many
MAX_SAMPLE = 4096


class StepRecorder:
    """The turns of each trajectory of the current step, from ``observe`` alone; on
    :meth:`close` the finished ones become the sample of the step."""

    def __init__(self, max_sample: int = MAX_SAMPLE) -> None:
        self._live: dict[str, _Seen] = {}
        self._done: deque[_Seen] = deque(maxlen=max_sample)
        self._arrivals = 0
        self.sample: list[list[Turn]] = []  # the last closed step's trajectories, by arrival
        self.prompts: list[str] = []  # their first prompts' identities (GRPO siblings share one)

    def observe(self, traj: TrajectoryView) -> None:
        seen = self._live.get(traj.id)
        if seen is None or traj.turns < len(seen.turns):  # a new trajectory (ids are reused)
            self._arrivals += 1
            seen = self._live[traj.id] = _Seen(self._arrivals, traj.prompt_id)
        if traj.turns > len(seen.turns):
            out = traj.last_output_tokens
            prompt = max(0, traj.context_tokens - out)
            new = prompt - seen.context if prompt >= seen.context else prompt
            seen.turns.append(Turn(new, out, max(0.0, traj.tool_time_s - seen.tool_s)))
            seen.context, seen.tool_s = traj.context_tokens, traj.tool_time_s
        if traj.phase is Phase.FINISHED:
            if seen.turns:
                self._done.append(seen)
            del self._live[traj.id]

    def close(self, keep_live: bool = False) -> None:
        """End the step: its finished trajectories, in the order they arrived, are the
        new sample (a step that finished none keeps the old one). ``keep_live``: the
        trajectories still running go on into the next sample (a weight push under a
        step mode that never drains the pool), else they are forgotten."""
        if self._done:
            done = sorted(self._done, key=lambda d: d.order)
            self.sample = [d.turns for d in done]
            self.prompts = [d.prompt for d in done]
            self._done.clear()
        if not keep_live:
            self._live.clear()


def _step_s(sp: TPSpeed, n: int, ctx: float) -> float:
    step = max(sp.decode_step_s(n, ctx), sp.per_token_s * 0.5)
    over = max(1.0, n / MAX_NUM_SEQS, ctx / sp.kv_tokens if sp.kv_tokens else 1.0)
    return step * over  # more than fits runs in turns: as many steps again per excess


def instance_s(trajs: Sequence[Sequence[Turn]], sp: TPSpeed, tool_scale: float,
                prompts: Sequence[str] | None = None) -> float:
    """When the last of ``trajs`` ends, all on one instance from time 0.

    The engine's prefix cache is modelled in two ways: a trajectory whose first prompt
    (``prompts``, parallel to ``trajs``: a GRPO group's members share one) already started
    on the instance finds it cached; a trajectory back from a tool finds its context
    cached as far as the decoders leave room for the contexts parked in tool gaps
    (evicted in proportion otherwise), and prefills the rest again.

    Known simplifications: a shared prompt is prefilled once but still counted once per
    sibling in the KV room (the engine shares its blocks), so KV pressure is overstated
    on an instance holding many siblings; and eviction is judged when a trajectory
    returns, not at the tightest moment of its tool gap, nor oldest first as the
    engine's LRU evicts."""
    t = v = debt = 0.0  # real time, tokens each decoder has made, prefill still to run
    n, cbase = 0, 0.0  # decoders; their context is cbase + n*v
    decoding: list[tuple[float, int]] = []  # (v at which it ends its call, traj)
    tools: list[tuple[float, int]] = []  # (time its next call starts, traj)
    nxt = [0] * len(trajs)
    ctx = [0.0] * len(trajs)
    base = [0.0] * len(trajs)  # each decoder's context minus v at its start
    parked = 0.0  # context of trajectories in a tool gap: cached, evictable blocks
    started: set[str] = set()  # first prompts in the cache
    end = 0.0
    for k, turns in enumerate(trajs):
        heapq.heappush(tools, (turns[0].tool_s * tool_scale, k))

    def advance(dt: float, dv_end: float | None) -> None:
        nonlocal t, v, debt
        spend = min(debt, dt)
        debt -= spend
        if n and dt > spend:
            if dv_end is not None:
                dv = dv_end
            else:
                dv = (dt - spend) / _step_s(sp, n, cbase + n * v)
                dv = (dt - spend) / _step_s(sp, n, cbase + n * (v + dv / 2))
            v += dv
        t += dt

    while decoding or tools:
        dec_t = None
        if decoding:
            dv = decoding[0][0] - v
            dec_t = t + debt + dv * _step_s(sp, n, cbase + n * (v + dv / 2))
        if tools and (dec_t is None or tools[0][0] <= dec_t):
            at, k = heapq.heappop(tools)
            advance(max(0.0, at - t), None)
            turn = trajs[k][nxt[k]]
            fresh = float(turn.new_tokens)
            if nxt[k] and sp.kv_tokens:  # its cached context, evicted while it waited?
                room = max(0.0, sp.kv_tokens - (cbase + n * v))  # what the decoders leave
                fresh += ctx[k] * (1.0 - min(1.0, room / parked)) if parked > 0 else 0.0
                parked -= ctx[k]
            elif not nxt[k] and prompts is not None:
                if prompts[k] in started:
                    fresh = 0.0  # a sibling's prompt: cached
                started.add(prompts[k])
            debt += fresh * sp.prefill_s_per_token
            ctx[k] += turn.new_tokens
            if sp.kv_tokens and ctx[k] + turn.output_tokens > sp.kv_tokens:
                return math.inf  # one call needs more KV than the instance has
            base[k] = ctx[k] - v
            cbase += base[k]
            n += 1
            heapq.heappush(decoding, (v + max(1, turn.output_tokens), k))
        else:
            assert dec_t is not None
            ends, k = heapq.heappop(decoding)
            advance(dec_t - t, ends - v)
            n -= 1
            cbase -= base[k]
            ctx[k] += trajs[k][nxt[k]].output_tokens
            nxt[k] += 1
            if nxt[k] < len(trajs[k]):
                heapq.heappush(tools, (t + trajs[k][nxt[k]].tool_s * tool_scale, k))
                parked += ctx[k]
            else:
                end = max(end, t)
    return end


def replay_makespan(sample: Sequence[Sequence[Turn]], layout: Sequence[int],
                    speeds: Mapping[int, TPSpeed], tool_scale: float = 1.0,
                    prompts: Sequence[str] | None = None) -> float:
    """Estimated makespan of ``sample`` on ``layout`` (TP degrees), verl's routing:
    trajectories round robin over the instances in arrival order (the sample's order),
    then sticky. Seconds of the speeds' (engine) time; ``tool_scale`` converts the
    sample's tool times to it; ``prompts`` (first-prompt identities, parallel to
    ``sample``) lets siblings on one instance share their first prompt."""
    ids = prompts if prompts is not None else [str(i) for i in range(len(sample))]
    per: list[list[Sequence[Turn]]] = [[] for _ in layout]
    per_prompt: list[list[str]] = [[] for _ in layout]
    kept = [i for i, t in enumerate(sample) if t]
    for j, i in enumerate(kept):
        per[j % len(layout)].append(sample[i])
        per_prompt[j % len(layout)].append(ids[i])
    return max((instance_s(ts, speeds[tp], tool_scale, ps)
                for ts, ps, tp in zip(per, per_prompt, layout, strict=True) if ts),
               default=0.0)


def probe_layout(gpus: int, degrees: Sequence[int] = (1, 2, 4, 8)) -> tuple[int, ...]:
    """One instance of each degree, smallest first while they fit, the GPUs left over at
    the highest degree that fits them (16 GPUs: 8, 4, 2, 1, 1; 8 GPUs: 4, 2, 1, 1)."""
    chosen: list[int] = []
    for tp in sorted(degrees):
        if sum(chosen) + tp <= gpus:
            chosen.append(tp)
    rest = gpus - sum(chosen)
    for tp in sorted(degrees, reverse=True):
        while tp <= rest:
            chosen.append(tp)
            rest -= tp
    return tuple(sorted(chosen, reverse=True))
