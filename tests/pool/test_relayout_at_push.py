"""A relayout at a weight push, live: the policy's ``at_pause`` changes the layout while the
engines are paused, the calls the push aborted go on on the new instances, token in.

The policy here always proposes one TP2 for the two TP1s at a push (``replay`` proposes
what it measured fastest; the simulator measures what that is worth); what is checked is
the mechanism: every call in flight at the push ends with all its tokens, the part after
the push stamped with the new version and run on the new instance, nothing lost from the
record, the old instances stopped.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from gateway.policies.base import Relayout, Snapshot
from tests.pool.conftest import ADMIN, PoolGateway
from tests.pool.test_pool_sim import MODEL, client, ready_pool, sim_spec
from tests.pool.test_weights import checkpoint
from tests.pool.workload import wait_job

TOKENS = 600


class RelayoutAtPush:
    """The gateway's policy, but at a weight push it asks for one TP2 in place of every
    instance it finds."""

    def __init__(self, inner: Any, launch: tuple[int, ...] = (2,)) -> None:
        self.inner = inner
        self.launch = launch
        self.asked = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def at_pause(self, snap: Snapshot) -> Relayout | None:
        self.asked += 1
        return Relayout(tuple(i.id for i in snap.instances), self.launch, "test, at the push")


async def _call(c: httpx.AsyncClient, tid: str, stream: bool) -> tuple[int, list[str]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"go {tid}"}],
            "max_tokens": TOKENS, "ignore_eos": True, "stream": stream}
    headers = {"x-trajectory-id": tid}
    if not stream:
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return r.json()["usage"]["completion_tokens"], [choice["finish_reason"]]
    finishes = []
    async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:]).get("choices") or []:
                    if ch.get("finish_reason"):
                        finishes.append(ch["finish_reason"])
    return -1, finishes


async def test_a_relayout_at_a_push_moves_the_aborted_calls_to_the_new_instances(
        pool_gateway: PoolGateway, tmp_path: Path) -> None:
    spec = sim_spec(gpus=2, speed=10, layout=[{"tp": 1, "count": 2}])
    with pool_gateway(spec) as gw:
        async with client(gw) as c:
            pool = await ready_pool(c)
            assert sorted(i["id"] for i in pool["instances"]) == ["tp1-g0", "tp1-g1"]
            scheduler = gw.rt.dispatcher.scheduler
            policy = RelayoutAtPush(scheduler.policy)
            gw.loop.run(_set_policy(scheduler, policy))
            calls = [asyncio.create_task(_call(c, f"t{i}", stream=i % 2 == 1))
                     for i in range(4)]
            await asyncio.sleep(0.5)  # every call is generating on one of the TP1s
            assert not any(t.done() for t in calls)
            r = await c.post("/admin/weight-update", headers=ADMIN, json={
                "version": "1", "method": "reload",
                "weights_path": checkpoint(tmp_path, "step-1")})
            assert r.status_code == 202, r.text
            update = await wait_job(c, r.json()["job"], 60)
            assert update["status"] == "succeeded", update
            assert policy.asked == 1
            moved = update["plan"]["relayout"]
            assert sorted(moved["retire"]) == ["tp1-g0", "tp1-g1"] and moved["launch"] == [2]
            relayout = await wait_job(c, moved["job"], 60)
            assert relayout["status"] == "succeeded", relayout
            results = await asyncio.gather(*calls)
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
            assert [(i["id"], i["tp"], i["state"]) for i in pool["instances"]] == [
                ("tp2-g0-1", 2, "ready")]
            records = {f"t{i}": (await c.get(f"/trajectories/t{i}", headers=ADMIN)).json()
                       ["calls"] for i in range(4)}
    for (n, finishes), tid in zip(results, records, strict=True):
        (call,) = records[tid]
        assert finishes == ["length"], (tid, finishes)  # one end, no abort seen
        assert len(call["completion_ids"]) == TOKENS, tid  # every token, each once
        assert n in (-1, TOKENS)
        # the tokens before the push from "0" on a TP1, after it "1" on the TP2
        versions = [seg[2] for seg in call["weight_segments"] or []]
        assert versions == ["0", "1"], (tid, call["weight_segments"])
        assert call["backend_id"] == "tp2-g0-1" and call["tp"] == 2, tid


async def _set_policy(scheduler: Any, policy: Any) -> None:
    scheduler.set_policy(policy)


async def test_a_relayout_the_pool_refuses_leaves_the_instances_serving(
        pool_gateway: PoolGateway, tmp_path: Path) -> None:
    """A TP4 on a pool of two GPUs cannot be placed: the push goes on as without it, the
    two TP1s serve again and finish the calls, and the job says why."""
    with pool_gateway(sim_spec(gpus=2, speed=10, layout=[{"tp": 1, "count": 2}])) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            scheduler = gw.rt.dispatcher.scheduler
            gw.loop.run(_set_policy(scheduler, RelayoutAtPush(scheduler.policy, (4,))))
            calls = [asyncio.create_task(_call(c, f"r{i}", stream=i % 2 == 1))
                     for i in range(2)]
            await asyncio.sleep(0.5)
            r = await c.post("/admin/weight-update", headers=ADMIN, json={
                "version": "1", "method": "reload",
                "weights_path": checkpoint(tmp_path, "step-1")})
            update = await wait_job(c, r.json()["job"], 60)
            assert update["status"] == "succeeded", update
            assert "refused" in update["plan"]["relayout"]
            results = await asyncio.gather(*calls)
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
            assert [(i["id"], i["state"]) for i in pool["instances"]] == [
                ("tp1-g0", "ready"), ("tp1-g1", "ready")]
            for i in range(2):
                (call,) = (await c.get(f"/trajectories/r{i}", headers=ADMIN)).json()["calls"]
                assert len(call["completion_ids"]) == TOKENS
                assert [seg[2] for seg in call["weight_segments"]] == ["0", "1"]
    assert all(finishes == ["length"] for _, finishes in results)
