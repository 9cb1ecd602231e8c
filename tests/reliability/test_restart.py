"""A real gateway process restarted in the middle of a batch of multi-turn trajectories.

The second process has never seen the trajectories: on the first call of each it restores
the trajectory's state from the store (next ``seq``, last prompt + completion tokens,
group). The test compares every trajectory of the interrupted batch with the same
trajectory run uninterrupted (same prompts, same per-turn sampling ``seed``, so the
simulated engine answers identically): the training samples must be equal, ``seq`` must
continue across the restart, the first prompt after it must be stored as a delta (not
whole at offset 0), and no mismatch may appear.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.conftest import MODEL
from tests.reliability.procs import Child
from tests.servers import free_port

TRAJECTORIES, TURNS, RESTART_AT = 6, 6, 3


def _gateway(backend: str, db: str, tmp_path: Path, port: int, name: str) -> Child:
    env = {"ROLLOUT_GATEWAY_SERVER__SHUTDOWN_DELAY_S": "0",
           "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(tmp_path / f"{name}-spool.jsonl"),
           "ROLLOUT_GATEWAY_POLICY": "progressive"}
    child = Child(["serve", "--port", str(port), "--backend", backend, "--database-url", db],
                  port, env=env, log=tmp_path / f"{name}.log")
    child.wait_ready()
    return child


class Agent:
    """One trajectory's client side: it keeps its message history across the restart."""

    def __init__(self, tid: str, group: str, task: int) -> None:
        self.tid, self.group, self.task = tid, group, task
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"solve task {task} step by step"}]
        self.turn = 0

    async def step(self, http: httpx.AsyncClient, url: str, *, grouped: bool) -> None:
        path = f"/g/{self.group}/t/{self.tid}" if grouped else f"/t/{self.tid}"
        r = await http.post(f"{url}{path}/v1/chat/completions", json={
            "model": MODEL, "messages": self.messages, "max_tokens": 12,
            "seed": 1000 * self.task + self.turn})
        assert r.status_code == 200, f"{self.tid} turn {self.turn}: {r.text}"
        content = r.json()["choices"][0]["message"]["content"] or ""
        self.messages += [{"role": "assistant", "content": content},
                          {"role": "user", "content": f"tool output {self.turn}"}]
        self.turn += 1


async def _turns(http: httpx.AsyncClient, url: str, agents: list[Agent], until: int,
                 *, grouped: bool) -> None:
    async def run(agent: Agent) -> None:
        while agent.turn < until:
            await agent.step(http, url, grouped=grouped)

    await asyncio.gather(*(run(a) for a in agents))


def _comparable(sample: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in sample.items() if k not in ("trajectory_id", "calls")}
    out["calls"] = [(c["seq"], c["prompt_start"], c["completion_start"], c["completion_end"])
                    for c in sample["calls"]]
    return out


async def test_restart_mid_batch_continues_every_trajectory_as_if_uninterrupted(
        sim_children, db_url: str, tmp_path: Path) -> None:
    sim = sim_children(speed=50.0)
    port = free_port()
    run = tmp_path.name[-8:]
    cut = [Agent(f"cut-{run}-{i}", f"grp-{run}-{i % 2}", i) for i in range(TRAJECTORIES)]
    ref = [Agent(f"ref-{run}-{i}", f"grp-{run}-{i % 2}", i) for i in range(TRAJECTORIES)]
    first = _gateway(sim.url, db_url, tmp_path, port, "first")
    async with httpx.AsyncClient(timeout=60) as http:
        try:
            await _turns(http, first.url, cut, RESTART_AT, grouped=True)
        finally:
            first.signal(signal.SIGTERM)
            rc = await asyncio.to_thread(first.proc.wait, 30)
        assert rc in (0, -signal.SIGTERM), first.output()
        second = _gateway(sim.url, db_url, tmp_path, port, "second")
        try:
            # after the restart the agents call without the group in the path: the
            # restored state carries it
            await asyncio.gather(_turns(http, second.url, cut, TURNS, grouped=False),
                                 _turns(http, second.url, ref, TURNS, grouped=True))
            for agent in cut + ref:
                r = await http.post(f"{second.url}/trajectories/{agent.tid}/finish",
                                    json={"reward": float(agent.task)})
                assert r.status_code == 200 and r.json()["attempt"] == 0, r.text
            for a, b in zip(cut, ref, strict=True):
                got = (await http.get(f"{second.url}/trajectories/{a.tid}/sample")).json()
                want = (await http.get(f"{second.url}/trajectories/{b.tid}/sample")).json()
                assert want["mismatches"] == [] and len(want["calls"]) == TURNS
                assert _comparable(got) == _comparable(want), a.tid
                assert got["group_id"] == a.group
                calls = (await http.get(f"{second.url}/trajectories/{a.tid}")).json()["calls"]
                assert [(c["attempt"], c["seq"]) for c in calls] == [
                    (0, s) for s in range(TURNS)]
                after = calls[RESTART_AT]
                assert after["prompt_offset"] > 0 and after["mismatch_pos"] is None
                assert after["prompt_offset"] == calls[RESTART_AT - 1]["prompt_offset"] + len(
                    calls[RESTART_AT - 1]["prompt_delta_ids"]) + len(
                    calls[RESTART_AT - 1]["completion_ids"])
            status = (await http.get(f"{second.url}/status")).json()
            assert status["scheduler"]["faults"] == 0 and status["scheduler"]["queued"] == 0
            # the cut trajectories came back from the store; the new ones were only asked
            # for in batches (at most one query per id, usually far fewer)
            restore = status["restore"]
            assert restore["restored"] == TRAJECTORIES and restore["failures"] == 0
            assert 1 <= restore["existence_queries"] <= 2 * TRAJECTORIES
        finally:
            second.stop()
