"""What the restart scenarios share: agents that keep their history across a gateway
restart, gateway processes started and stopped as an operator would, and the check that a
cut trajectory's sample equals an uninterrupted reference's."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.conftest import MODEL
from tests.reliability.procs import Child
from tests.servers import free_port

TRAJECTORIES, TURNS, RESTART_AT = 6, 6, 3


@dataclass
class Tally:
    """What the agents saw after the restart (the figures RELIABILITY.md reports)."""

    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    retry_after: set[str] = field(default_factory=set)
    first_call_s: list[float] = field(default_factory=list)  # per trajectory, retries in


class Agent:
    """One trajectory's client: it keeps its message history across the restart."""

    def __init__(self, tid: str, group: str, task: int) -> None:
        self.tid, self.group, self.task = tid, group, task
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"solve task {task} step by step"}]
        self.turn = 0

    async def step(self, http: httpx.AsyncClient, url: str, *, grouped: bool = True,
                   tally: Tally | None = None) -> None:
        """One turn. With ``tally``, a 503 (the store did not answer) is counted and
        retried after its Retry-After, as OpenAI clients do; without, it fails the test."""
        path = f"/g/{self.group}/t/{self.tid}" if grouped else f"/t/{self.tid}"
        while True:
            r = await http.post(f"{url}{path}/v1/chat/completions", json={
                "model": MODEL, "messages": self.messages, "max_tokens": 12,
                "seed": 1000 * self.task + self.turn})
            if tally is None:
                break
            tally.statuses[r.status_code] += 1
            if r.status_code != 503:
                break
            error = r.json()["error"]
            tally.codes[error["code"]] += 1
            tally.retry_after.add(r.headers["retry-after"])
            assert "not run" in error["message"], error
            await asyncio.sleep(float(r.headers["retry-after"]))
        assert r.status_code == 200, f"{self.tid} turn {self.turn}: {r.text}"
        content = r.json()["choices"][0]["message"]["content"] or ""
        self.messages += [{"role": "assistant", "content": content},
                          {"role": "user", "content": f"tool output {self.turn}"}]
        self.turn += 1


def agents(run: str, kind: str) -> list[Agent]:
    return [Agent(f"{kind}-{run}-{i}", f"grp-{run}-{i % 2}", i) for i in range(TRAJECTORIES)]


async def turns(http: httpx.AsyncClient, url: str, crowd: list[Agent], until: int, *,
                grouped: bool = True, tally: Tally | None = None) -> None:
    """Every agent takes turns until its ``until``-th, all at once."""
    async def run(agent: Agent) -> None:
        first = agent.turn
        while agent.turn < until:
            t0 = time.monotonic()
            await agent.step(http, url, grouped=grouped, tally=tally)
            if tally is not None and agent.turn == first + 1:
                tally.first_call_s.append(time.monotonic() - t0)

    await asyncio.gather(*(run(a) for a in crowd))


def start_gateway(backend: str, db: str, tmp_path: Path, name: str, *, policy: str,
                  port: int | None = None, spool: str = "spool.jsonl",
                  env: dict[str, str] | None = None) -> Child:
    port = port or free_port()
    child = Child(["serve", "--port", str(port), "--backend", backend, "--database-url", db],
                  port, log=tmp_path / f"{name}.log", env={
                      "ROLLOUT_GATEWAY_SERVER__SHUTDOWN_DELAY_S": "0",
                      "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(tmp_path / spool),
                      "ROLLOUT_GATEWAY_POLICY": policy, **(env or {})})
    try:
        child.wait_ready(timeout_s=90)
    except BaseException:
        child.stop()
        raise
    return child


async def stop_gateway(gw: Child, timeout_s: float = 60) -> None:
    """SIGTERM, as an operator's restart sends; it must exit cleanly."""
    gw.signal(signal.SIGTERM)
    rc = await asyncio.to_thread(gw.proc.wait, timeout_s)
    assert rc in (0, -signal.SIGTERM), gw.output()


def comparable(sample: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in sample.items() if k not in ("trajectory_id", "calls")}
    out["calls"] = [(c["seq"], c["prompt_start"], c["completion_start"], c["completion_end"])
                    for c in sample["calls"]]
    return out


async def check_as_uninterrupted(http: httpx.AsyncClient, url: str, cut: list[Agent],
                                 ref: list[Agent]) -> dict[str, Any]:
    """Finish every trajectory; each cut one's sample equals its reference's, its calls
    are seq 0..TURNS-1 of attempt 0 with no mismatch and every generated token under the
    loss mask. Returns ``/status``."""
    for agent in cut + ref:
        r = await http.post(f"{url}/trajectories/{agent.tid}/finish",
                            json={"reward": float(agent.task)})
        assert r.status_code == 200 and r.json()["attempt"] == 0, r.text
    for a, b in zip(cut, ref, strict=True):
        got = (await http.get(f"{url}/trajectories/{a.tid}/sample")).json()
        want = (await http.get(f"{url}/trajectories/{b.tid}/sample")).json()
        assert want["mismatches"] == [] and len(want["calls"]) == TURNS
        assert comparable(got) == comparable(want), a.tid
        assert got["group_id"] == a.group
        calls = (await http.get(f"{url}/trajectories/{a.tid}")).json()["calls"]
        assert [(c["attempt"], c["seq"]) for c in calls] == [(0, s) for s in range(TURNS)]
        assert all(c["mismatch_pos"] is None for c in calls)
        assert sum(got["loss_mask"]) == sum(len(c["completion_ids"]) for c in calls)
    status: dict[str, Any] = (await http.get(f"{url}/status")).json()
    return status
