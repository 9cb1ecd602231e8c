"""Seeded agentic-RL workloads from ``data/workloads.json`` (a copy of the shared one).

Per prompt: a difficulty ``u ~ LN(1, 0.5)`` scales turns by ``sqrt(u)`` and output tokens
by ``u``, so members of one GRPO group are correlated. Per trajectory: prompt tokens
(shared by the group), turns, output tokens per turn, observation tokens and tool
latency per tool call, and the tool outcome state. These hidden lengths are what a
harness forces with ``max_tokens`` + ``ignore_eos``; no policy may read them (the
simulator hands them only to the oracle).

Modelling choices not in the JSON (estimates, listed here):
- Tool names: swe ``bash``; search ``search`` / ``browse`` (by observation component);
  math-code ``python``; tau ``db`` / ``user`` (by latency component).
- ``uniform`` latency components (swe 30-60 s, math-code 10-30 s) are timeouts.
- Failure probability ``min(0.5, 0.15*sqrt(u))`` for code tools, 5% otherwise.
- A trajectory ends early if its context would exceed ``max_context`` tokens.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from gateway.trajectories.tools import size_class

CODE_TOOLS = {"swe": "bash", "math-code": "python"}


@dataclass(frozen=True, slots=True)
class Turn:
    output_tokens: int
    obs_tokens: int  # observation appended after this turn (0 after the last)
    tool_s: float  # tool latency after this turn (0 after the last)
    tool_state: str  # ``tool:size:outcome`` of that observation ("" after the last)


@dataclass(frozen=True, slots=True)
class TrajectorySpec:
    id: str
    group_id: str
    prompt_id: str
    prompt_index: int
    prompt_tokens: int
    setup_s: float
    reward_s: float
    turns: tuple[Turn, ...]

    @property
    def total_output(self) -> int:
        return sum(t.output_tokens for t in self.turns)


@cache
def load_workloads() -> dict[str, Any]:
    text = resources.files("bench").joinpath("data/workloads.json").read_text()
    data: dict[str, Any] = json.loads(text)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def draw(rng: random.Random, spec: Any) -> tuple[float, int]:
    """A sample of a distribution spec and the mixture component it came from."""
    if isinstance(spec, int | float):
        return float(spec), 0
    if "mixture" in spec:
        r = rng.random()
        for idx, (p, sub) in enumerate(spec["mixture"]):
            r -= p
            if r <= 0 or idx == len(spec["mixture"]) - 1:
                return draw(rng, sub)[0], idx
    if "ln" in spec:
        med, sigma = spec["ln"]
        value = med * math.exp(sigma * rng.gauss(0.0, 1.0))
    elif "uniform" in spec:
        value = rng.uniform(*spec["uniform"])
    else:
        value = float(spec["fixed"])
    return (min(value, spec["cap"]) if "cap" in spec else value), 0


def _tool(workload: str, obs_comp: int, lat_comp: int, lat_spec: Any) -> str:
    if workload == "search":
        return "browse" if obs_comp == 1 else "search"
    if workload == "tau":
        return "user" if lat_comp == 1 else "db"
    return CODE_TOOLS.get(workload, "tool")


def _outcome(rng: random.Random, workload: str, u: float, timeout: bool) -> str:
    if timeout:
        return "timeout"
    p_fail = min(0.5, 0.15 * math.sqrt(u)) if workload in CODE_TOOLS else 0.05
    return "failure" if rng.random() < p_fail else "success"


def _turns(rng: random.Random, name: str, w: dict[str, Any], u: float, prompt: int,
           max_context: int) -> tuple[Turn, ...]:
    t = w["turns"]
    n = max(1, min(t["cap"], round(t["base"] + draw(rng, {"ln": t["ln"]})[0] * math.sqrt(u))))
    out_spec = w["output_tokens_per_turn"]
    traj_cap = out_spec.get("trajectory_cap", 1 << 30)
    turns: list[Turn] = []
    ctx, total = prompt, 0
    for i in range(n):
        out = max(1, round(min(draw(rng, {"ln": out_spec["ln"]})[0] * u,
                               out_spec.get("cap", 1 << 30))))
        out = min(out, traj_cap - total, max_context - ctx)
        obs_v, obs_c = draw(rng, w["observation_tokens"])
        lat, lat_c = draw(rng, w["tool_latency_s"])
        obs = max(1, round(obs_v))
        last = i == n - 1 or total + out >= traj_cap or ctx + out + obs + 64 >= max_context
        if last:
            turns.append(Turn(max(1, out), 0, 0.0, ""))
            break
        lat_spec = w["tool_latency_s"]["mixture"][lat_c][1]
        state = (f"{_tool(name, obs_c, lat_c, lat_spec)}:{size_class(obs)}:"
                 f"{_outcome(rng, name, u, 'uniform' in lat_spec)}")
        turns.append(Turn(out, obs, lat, state))
        ctx += out + obs
        total += out
    return tuple(turns)


def prompt_group(name: str, w: dict[str, Any], p: int, *, task: random.Random,
                 samples: random.Random, size: int,
                 max_context: int = 65536) -> list[TrajectorySpec]:
    """Prompt ``p``'s GRPO group of ``size`` trajectories.

    ``task`` draws what belongs to the prompt (its difficulty and length), ``samples``
    what belongs to each sample (setup, reward, turns). :func:`generate` passes one
    generator for both; ``bench steps`` keeps the prompt fixed across steps and draws
    new samples each step, so it passes two.
    """
    u = math.exp(0.5 * task.gauss(0.0, 1.0))
    prompt = max(16, round(draw(task, w["prompt_tokens"])[0]))
    out: list[TrajectorySpec] = []
    for m in range(size):
        setup = draw(samples, w["setup_s"])[0] if "setup_s" in w else 0.0
        reward = draw(samples, w["reward_s"])[0] if "reward_s" in w else 0.0
        out.append(TrajectorySpec(
            id=f"{name}-p{p}-m{m}", group_id=f"g{p}", prompt_id=f"{name}-prompt-{p}",
            prompt_index=p, prompt_tokens=prompt, setup_s=setup, reward_s=reward,
            turns=_turns(samples, name, w, u, prompt, max_context)))
    return out


def generate(name: str, seed: int, *, prompts: int | None = None,
             group_size: int | None = None, max_context: int = 65536) -> list[TrajectorySpec]:
    """The batch of workload ``name`` for ``seed`` (same seed, same batch, any machine)."""
    table = load_workloads()
    if name not in table:
        raise ValueError(f"unknown workload {name!r}; available: {', '.join(sorted(table))}")
    w = table[name]
    n_prompts = prompts or w["prompts"]
    size = group_size or w["group_size"]
    out: list[TrajectorySpec] = []
    for p in range(n_prompts):
        rng = random.Random(f"{seed}:{name}:{p}")
        out += prompt_group(name, w, p, task=rng, samples=rng, size=size,
                            max_context=max_context)
    return out
