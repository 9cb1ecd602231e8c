"""The reported wedge, as a trainer meets it: RL steps through a managed sim pool that
reuse the previous step's trajectory ids (``<prompt>-<sample>``), many calls queued in
the gateway at once. Before the fix, step 2's first queued call of a reused id raised
``KeyError`` in the policy on every pass and every queued call, fresh ids included, hung.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.pool.conftest import ADMIN, PoolGateway
from tests.pool.test_pool_sim import MODEL, client, ready_pool, sim_spec

PROMPTS, SAMPLES, TURNS, STEPS = 4, 3, 3, 3


async def _rollout(c: httpx.AsyncClient, tid: str, group: str, step: int) -> int:
    """One multi-turn episode, then finish with a reward; returns the finished attempt."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {group} step {step}"}]
    for turn in range(TURNS):
        r = await c.post(f"/g/{group}/t/{tid}/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 8})
        assert r.status_code == 200, f"{tid} step {step} turn {turn}: {r.text}"
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]
                      ["content"] or ""}, {"role": "user", "content": f"tool said {turn}"}]
        await asyncio.sleep(0.01)
    r = await c.post(f"/trajectories/{tid}/finish", json={"reward": float(step)})
    assert r.status_code == 200, r.text
    return int(r.json()["attempt"])


@pytest.mark.parametrize("policy", ["straggler-lane", "progressive", "slime", "libra"])
async def test_steps_reusing_trajectory_ids_never_wedge_the_pool(
        pool_gateway: PoolGateway, policy: str) -> None:
    ids = [(f"p{p}-{s}", f"p{p}") for p in range(PROMPTS) for s in range(SAMPLES)]
    with pool_gateway(sim_spec(gpus=2), cap_per_gpu=2, policy=policy) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            for step in range(STEPS):
                batch = [_rollout(c, tid, group, step) for tid, group in ids]
                if step:  # a fresh id rides along with the reused ones
                    batch.append(_rollout(c, f"fresh-{step}", "fresh", 0))
                attempts = await asyncio.wait_for(asyncio.gather(*batch), 60)
                assert attempts[:len(ids)] == [step] * len(ids)
            status = (await c.get("/status")).json()["scheduler"]
            assert status["faults"] == 0 and status["queued"] == 0, status
            assert status["stalls"] == 0, status
            for tid, group in ids:
                sample = (await c.get(f"/trajectories/{tid}/sample")).json()
                assert sample["attempt"] == STEPS - 1 and sample["reward"] == STEPS - 1
                assert sample["group_id"] == group
                assert [s["seq"] for s in sample["calls"]] == list(range(TURNS))
                old = (await c.get(f"/trajectories/{tid}/sample",
                                   params={"attempt": 0})).json()
                assert old["reward"] == 0.0 and [s["seq"] for s in old["calls"]] == [0, 1, 2]
                calls = (await c.get(f"/trajectories/{tid}", headers=ADMIN)).json()["calls"]
                assert sorted((k["attempt"], k["seq"]) for k in calls) == [
                    (a, s) for a in range(STEPS) for s in range(TURNS)]
            assert sum(b.in_flight for b in gw.rt.registry) == 0
            assert all(st.queued == 0 and st.in_flight == 0 for st in gw.rt.tracker)
