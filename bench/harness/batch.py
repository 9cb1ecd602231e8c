"""An emulated agent harness: runs a workload the way real agents would.

One asyncio task per trajectory, each with the official ``openai`` client pointed at its
trajectory-scoped base URL (``/g/{group}/t/{trajectory}/v1``). Each turn sends the whole
conversation so far, forces the turn's output length with ``max_tokens`` + ``ignore_eos``
(the gateway's policies never see those), then "runs the tool": waits the workload's
tool latency and appends an observation of the workload's size, named after the tool
and carrying the outcome's tell-tale text (a traceback, a timeout) as real tools do.
Finished trajectories report their reward to the gateway.

Time compression: the simulated servers run ``speed`` times faster than real time, and
the harness divides every tool and setup latency by the same factor, or, given the
servers' clock (``HarnessConfig.clock``), waits on that clock, so that a clock slowed
while the batch runs slows the agents with it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from backends.sim.clock import Clock
from bench.workloads import TrajectorySpec, Turn

_WORDS = (" the", " of", " to", " and", " in", " is", " it", " that", " for", " on", " with",
          " as", " be", " this", " file", " line", " error", " test", " function", " result")
_OUTCOME_TEXT = {
    "failure": "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad\n",
    "timeout": "command timed out after 30 seconds\n",
    "success": "exit code 0\n",
}


def filler(n_tokens: int, rng: random.Random) -> str:
    """About ``n_tokens`` tokens of text (one token per common word on BPE vocabularies)."""
    return "".join(rng.choice(_WORDS) for _ in range(max(0, n_tokens)))


@dataclass(frozen=True, slots=True)
class HarnessConfig:
    gateway_url: str
    model: str
    speed: float = 1.0
    stream: bool = True
    finish: bool = True
    seed: int = 0
    request_timeout_s: float = 600.0
    #: wait the workload's reward-computation time before finishing (real rollouts do;
    #: ``bench live`` turns it off to measure what ``bench sim`` measures)
    reward_latency: bool = True
    #: the simulated pool's clock, when it may slow down while the batch runs (the demo):
    #: the agents wait on it and results are in its seconds. None: wall time, waits
    #: divided by ``speed``, results converted by it
    clock: Clock | None = None

    def timebase(self) -> tuple[Callable[[], float], Callable[[float], Awaitable[None]], float]:
        """(now, sleep for simulated seconds, simulated seconds per unit of ``now``)."""
        if self.clock is not None:
            return self.clock.now, self.clock.sleep, 1.0
        speed = self.speed
        return time.monotonic, lambda s: asyncio.sleep(s / speed), speed


@dataclass(slots=True)
class TurnResult:
    start: float
    end: float
    output_tokens: int
    tool_s: float


@dataclass(slots=True)
class TrajectoryResult:
    id: str
    group_id: str
    start: float
    end: float = 0.0
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None
    setup_s: float = 0.0  # environment set-up before the first call (real seconds)
    reward_s: float = 0.0  # computing the reward after the last turn (real seconds)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)


@dataclass(slots=True)
class BatchResult:
    start: float
    end: float
    trajectories: list[TrajectoryResult]
    speed: float  # simulated seconds per unit of start/end (1.0 when they are simulated)

    @property
    def makespan_s(self) -> float:
        """Makespan in simulated seconds (wall time times the compression factor)."""
        return (self.end - self.start) * self.speed

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.trajectories)

    @property
    def errors(self) -> int:
        return sum(1 for t in self.trajectories if t.error)


class Agent:
    """One trajectory's agent loop."""

    def __init__(self, spec: TrajectorySpec, cfg: HarnessConfig, http: httpx2.AsyncClient) -> None:
        self.spec = spec
        self.cfg = cfg
        self.rng = random.Random(f"{cfg.seed}:{spec.id}")
        self._now, self._sleep, _ = cfg.timebase()
        base = f"{cfg.gateway_url}/g/{spec.group_id}/t/{spec.id}/v1"
        self.client = openai.AsyncOpenAI(base_url=base, api_key="EMPTY", http_client=http,
                                         max_retries=0, timeout=cfg.request_timeout_s)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a software agent. Use tools."},
            {"role": "user", "content": f"Task {spec.prompt_id}:" + filler(
                spec.prompt_tokens, random.Random(spec.prompt_id))},
        ]

    async def _llm(self, turn: Turn) -> tuple[str, int]:
        kwargs: dict[str, Any] = {
            "model": self.cfg.model, "messages": self.messages, "max_tokens": turn.output_tokens,
            "temperature": 1.0, "extra_body": {"ignore_eos": True},
        }
        if not self.cfg.stream:
            resp = await self.client.chat.completions.create(**kwargs)
            usage = resp.usage.completion_tokens if resp.usage else turn.output_tokens
            return resp.choices[0].message.content or "", usage
        stream = await self.client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs)
        parts, usage = [], turn.output_tokens
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
        return "".join(parts), usage

    def _observe(self, turn: Turn) -> dict[str, Any]:
        parts = turn.tool_state.split(":")
        tool, outcome = parts[0], parts[-1]
        text = _OUTCOME_TEXT.get(outcome, "") + filler(turn.obs_tokens, self.rng)
        return {"role": "user", "name": tool or "tool", "content": text}

    async def run(self) -> TrajectoryResult:
        spec, now, sleep = self.spec, self._now, self._sleep
        result = TrajectoryResult(spec.id, spec.group_id, now())
        try:
            await sleep(spec.setup_s)
            result.setup_s = now() - result.start
            for turn in spec.turns:
                t0 = now()
                text, n = await self._llm(turn)
                t1 = now()
                self.messages.append({"role": "assistant", "content": text})
                result.turns.append(TurnResult(t0, t1, n, turn.tool_s))
                if turn.obs_tokens or turn.tool_s:
                    await sleep(turn.tool_s)
                    self.messages.append(self._observe(turn))
            if self.cfg.reward_latency:
                t0 = now()
                await sleep(spec.reward_s)
                result.reward_s = now() - t0
        except (openai.APIError, httpx2.HTTPError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        result.end = now()
        return result


async def finish_trajectory(http: httpx2.AsyncClient, cfg: HarnessConfig,
                            res: TrajectoryResult) -> None:
    reward = 0.0 if res.error else float(random.Random(res.id).random() < 0.5)
    await http.post(f"{cfg.gateway_url}/trajectories/{res.id}/finish",
                    json={"reward": reward, "group_id": res.group_id,
                          "metadata": {"turns": len(res.turns), "error": res.error}})


async def run_batch(
    specs: Sequence[TrajectorySpec],
    cfg: HarnessConfig,
    on_done: Callable[[TrajectoryResult], None] | None = None,
) -> BatchResult:
    """Run every trajectory of the batch concurrently; returns when the last one ends."""
    limits = httpx2.Limits(max_connections=len(specs) + 16, max_keepalive_connections=len(specs))
    # the openai client's own transport (httpx2), shared by every agent of the batch
    async with openai.DefaultAsyncHttpxClient(limits=limits, timeout=cfg.request_timeout_s) as http:
        now, _, per_unit = cfg.timebase()
        start = now()

        async def one(spec: TrajectorySpec) -> TrajectoryResult:
            res = await Agent(spec, cfg, http).run()
            if cfg.finish:
                await finish_trajectory(http, cfg, res)
            if on_done is not None:
                on_done(res)
            return res

        results = await asyncio.gather(*(one(s) for s in specs))
        return BatchResult(start, now(), list(results), per_unit)
