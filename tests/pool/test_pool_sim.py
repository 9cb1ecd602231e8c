"""The managed pool on simulated servers: layouts, resizes, drains, crashes, pause."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from backends.sim_launcher import SimLauncher
from tests.pool.conftest import ADMIN, Gateway, PoolGateway
from tests.pool.workload import Tally, calls_of, trajectory, wait_job

MODEL = "qwen3-14b"


def sim_spec(gpus: int = 4, speed: float = 50, median: int = 20, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "inventory": {"gpus": gpus},
            "launcher": {"kind": "sim", "speed": speed,
                         "options": {"output_len_median": median}},
            "layout": [{"tp": 1, "count": gpus}], "check_interval_s": 0.05,
            "restart": {"max_restarts": 2, "backoff_s": 0.05}, **kw}


def client(gw: Gateway) -> httpx.AsyncClient:
    # the admin token makes the model calls and sets rewards too (one role for every
    # request here; tests/gateway/test_security.py holds each route to its own role)
    return httpx.AsyncClient(base_url=gw.url, timeout=120, headers=ADMIN)


async def ready_pool(c: httpx.AsyncClient) -> dict[str, Any]:
    job = await wait_job(c, "1", 30)
    assert job["status"] == "succeeded", job
    pool: dict[str, Any] = (await c.get("/admin/pool", headers=ADMIN)).json()
    return pool


async def reconfigure(c: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await c.put("/admin/pool", json=body, headers=ADMIN)
    assert r.status_code == 202, r.text
    job = await wait_job(c, r.json()["job"], 60)
    assert job["status"] == "succeeded", job
    return job


async def test_initial_layout_registers_instances_with_tp_and_gpus(
        pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec()) as gw:
        async with client(gw) as c:
            pool = await ready_pool(c)
            backends = (await c.get("/admin/backends", headers=ADMIN)).json()["data"]
    assert pool["managed"] and pool["launcher"] == "sim"
    assert [(i["id"], i["state"], i["gpus"]) for i in pool["instances"]] == [
        (f"tp1-g{g}", "ready", [g]) for g in range(4)]
    assert {(b["id"], b["tp"], b["source"], b["healthy"]) for b in backends} == {
        (f"tp1-g{g}", 1, "sim", True) for g in range(4)}


async def test_reconfigure_under_traffic_loses_no_call_and_records_tp(
        pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec()) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            stop, tally = asyncio.Event(), Tally()
            tasks = [asyncio.create_task(trajectory(c, f"t{i}", MODEL, stop, tally))
                     for i in range(8)]
            timings = {}
            for name, body in [("4xTP1->2xTP2", {"layout": [{"tp": 2, "count": 2}]}),
                               ("2xTP2->1xTP4", {"layout": [{"tp": 4}]}),
                               ("1xTP4->4xTP1", {"layout": [{"tp": 1, "count": 4}]})]:
                await asyncio.sleep(0.3)
                timings[name] = (await reconfigure(c, body))["duration_s"]
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.gather(*tasks)
            calls = await calls_of(c, tally.trajectories)
    print("reconfiguration times (sim):", timings)
    assert tally.failed == []
    assert len(calls) == tally.ok > 40
    for call in calls:  # ids name the placement: tp2-g0-1 ran with TP2
        assert call["status"] == "ok"
        assert call["tp"] == int(call["backend_id"].split("-")[0][2:]), call
    assert {call["tp"] for call in calls} == {1, 2, 4}


async def test_resize_by_gpu_count_keeps_fitting_instances(pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec()) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            job = await reconfigure(c, {"gpus": 2})
            assert job["plan"] == {"keep": ["tp1-g0", "tp1-g1"], "stop": ["tp1-g2", "tp1-g3"],
                                   "start": []}
            job = await reconfigure(c, {"gpus": 4, "tp": 2})
            assert job["plan"]["start"] == ["tp2-g2-3"]
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
    assert [i["id"] for i in pool["instances"]] == ["tp1-g0", "tp1-g1", "tp2-g2-3"]
    assert pool["active_gpus"] == [0, 1, 2, 3]


@pytest.mark.parametrize(("body", "message"), [
    ({"layout": [{"tp": 8}]}, "no node has 8 free GPUs"),
    ({"layout": [{"tp": 1, "gpus": [7]}]}, "not available"),
    ({"gpus": 9}, "between 0 and 4"),
    ({"gpus": [0, 12]}, "not in the inventory"),
    ({"layout": [{"tp": 2, "gpus": [0]}]}, "needs 2 GPUs"),
])
async def test_impossible_layouts_are_refused_before_anything_stops(
        pool_gateway: PoolGateway, body: dict[str, Any], message: str) -> None:
    with pool_gateway(sim_spec()) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            r = await c.put("/admin/pool", json=body, headers=ADMIN)
            assert (await c.put("/admin/pool", json=body, headers={
                "Authorization": "Bearer wrong"})).status_code == 401
    assert r.status_code == 400 and message in r.json()["detail"], r.text


async def test_remove_drains_in_flight_calls_first(pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=2, speed=5, median=200)) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            stop, tally = asyncio.Event(), Tally()
            extra = {"ignore_eos": True}
            tasks = [asyncio.create_task(trajectory(c, f"t{i}", MODEL, stop, tally,
                                                    max_tokens=200, extra=extra))
                     for i in range(4)]
            await asyncio.sleep(0.3)
            r = await c.delete("/admin/backends/tp1-g0", headers=ADMIN)
            assert r.status_code == 202, r.text
            job = await wait_job(c, r.json()["job"], 60)
            stop.set()
            await asyncio.gather(*tasks)
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
    drain = next(p for p in job["phases"] if p["name"] == "drain")
    assert drain["in_flight"]["tp1-g0"] > 0 and "forced" not in drain
    assert tally.failed == []
    assert [i["id"] for i in pool["instances"]] == ["tp1-g1"]


async def test_crashed_instance_is_restarted_with_backoff(pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=1)) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            for n in (1, 2):
                inst = gw.rt.pool.instances["tp1-g0"]  # type: ignore[union-attr]
                launcher = gw.rt.pool.launcher  # type: ignore[union-attr]
                assert isinstance(launcher, SimLauncher) and inst.launched is not None
                gw.loop.run(launcher.crash(inst.launched))
                await _until(lambda n=n: _restarted(gw, n))
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            inst = gw.rt.pool.instances["tp1-g0"]  # type: ignore[union-attr]
            gw.loop.run(launcher.crash(inst.launched))  # type: ignore[arg-type]
            await _until(lambda: gw.rt.pool.instances["tp1-g0"].state.value == "failed")  # type: ignore[union-attr]
            await asyncio.sleep(0.5)
    events = [e["message"] for e in gw.rt.events if e["kind"] == "backend"]
    assert "tp1-g0 crashed" in events
    assert any("restart 2 of 2" in m for m in events)
    assert any("gave up after 2 restarts" in m for m in events)


def _restarted(gw: Gateway, n: int) -> bool:
    inst = gw.rt.pool.instances.get("tp1-g0")  # type: ignore[union-attr]
    return inst is not None and inst.restarts == n and inst.state.value == "ready"


async def _until(cond: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_policy_relayout_merges_instances_and_refuses_while_busy(
        pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec()) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            pool = gw.rt.pool
            assert pool is not None

            async def propose() -> str:  # on the gateway's loop, as the scheduler does
                job = pool.relayout(["tp1-g2", "tp1-g3"], [2], "tail")
                with pytest.raises(ValueError, match="already in progress"):
                    pool.relayout(["tp1-g0"], [1])
                return job.id

            done = await wait_job(c, gw.loop.run(propose()), 30)
    assert done["status"] == "succeeded"
    assert done["plan"] == {"keep": ["tp1-g0", "tp1-g1"], "stop": ["tp1-g2", "tp1-g3"],
                            "start": ["tp2-g2-3"]}
    assert done["request"]["reason"] == "tail"
