"""Pause/resume for weight sync: calls wait or get 429; versions switch exactly at resume."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import httpx

from tests.pool.conftest import ADMIN, PoolGateway
from tests.pool.test_pool_sim import MODEL, client, ready_pool, sim_spec
from tests.pool.workload import Tally, calls_of, trajectory

HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _dispatched(call: dict[str, Any]) -> float:
    return float(datetime.fromisoformat(call["started_at"]).timestamp()
                 + call["queued_ms"] / 1000)


async def test_pause_holds_new_calls_and_the_version_switches_at_resume(
        pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=2)) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            stop, tally = asyncio.Event(), Tally()
            tasks = [asyncio.create_task(trajectory(c, f"p{i}", MODEL, stop, tally))
                     for i in range(6)]
            await asyncio.sleep(0.5)
            paused = (await c.post("/admin/pause", json={"wait_idle": True},
                                   headers=ADMIN)).json()
            await c.put("/admin/weight-version", json={"version": "v1"}, headers=ADMIN)
            await asyncio.sleep(0.8)  # the trajectories' next calls arrive and wait
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
            resumed = (await c.post("/admin/resume", headers=ADMIN)).json()
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*tasks)
            calls = await calls_of(c, tally.trajectories)
    assert paused["paused"] and paused["idle"] is True and paused["in_flight"] == 0
    assert pool["paused"] is True
    assert resumed["paused_s"] >= 0.8 and resumed["weight_version"] == "v1"
    assert tally.failed == []
    old = [_dispatched(x) for x in calls if x["weight_version"] == "0"]
    new = [_dispatched(x) for x in calls if x["weight_version"] == "v1"]
    assert old and new and len(old) + len(new) == len(calls)
    assert max(old) + 0.7 < min(new)  # nothing dispatched while paused, and v1 only after
    held = [x for x in calls if x["weight_version"] == "v1" and x["queued_ms"] > 300]
    assert len(held) >= 3  # the calls that arrived during the pause waited, then ran on v1
    kinds = [e["kind"] for e in gw.rt.events]
    assert "pause" in kinds and "resume" in kinds


async def test_reject_mode_answers_429_with_retry_after(pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=1), pause_mode="reject", pause_retry_after_s=7) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            await c.post("/admin/pause", headers=ADMIN)
            refused = await c.post("/v1/chat/completions", json=HI)
            await c.post("/admin/resume", headers=ADMIN)
            served = await c.post("/v1/chat/completions", json=HI)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "7"
    assert refused.json()["error"]["code"] == "paused_for_weight_sync"
    assert served.status_code == 200


async def test_wait_mode_gives_up_with_429_after_max_wait(pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=1), pause_max_wait_s=0.3) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            await c.post("/admin/pause", headers=ADMIN)
            r = await c.post("/v1/chat/completions", json=HI)
            override = await c.post("/admin/pause", json={"mode": "reject"}, headers=ADMIN)
    assert r.status_code == 429 and "paused" in r.json()["error"]["message"]
    assert override.json()["mode"] == "reject"


async def test_admin_routes_need_the_token(pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=1)) as gw:
        async with httpx.AsyncClient(base_url=gw.url) as c:
            codes = [(await c.post(p)).status_code for p in ("/admin/pause", "/admin/resume")]
            codes.append((await c.get("/admin/jobs/1")).status_code)
            bad = (await c.post("/admin/pause",
                                headers={"Authorization": "Bearer wrong"})).status_code
    assert codes == [401, 401, 401] and bad == 401
