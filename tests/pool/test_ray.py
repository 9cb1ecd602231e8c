"""Ray: a local cluster declaring 8 logical GPUs; instances are actors running the
simulated server. A 4xTP1 + 1xTP4 layout comes up; a resize to 4 GPUs drains and
removes the TP4 instance without failing the calls running on it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pool.conftest import ADMIN, PoolGateway
from tests.pool.test_pool_sim import MODEL, client
from tests.pool.workload import Tally, calls_of, trajectory, wait_job

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="install the 'ray' extra")
    ray.init(num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


def ray_spec() -> dict[str, Any]:
    return {"model": MODEL, "inventory": {"gpus": 8},
            "launcher": {"kind": "ray", "server": "sim", "cpus_per_instance": 0,
                         "start_timeout_s": 120,
                         "sim": {"speed": 5, "options": {"output_len_median": 100}}},
            "layout": [{"tp": 1, "count": 4}, {"tp": 4}], "drain_timeout_s": 60}


async def test_actors_come_up_and_resize_drains_without_failures(
        ray_cluster: Any, pool_gateway: PoolGateway) -> None:
    with pool_gateway(ray_spec()) as gw:
        async with client(gw) as c:
            initial = await wait_job(c, "1", 180)
            assert initial["status"] == "succeeded", initial
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
            gpus_left = ray_cluster.available_resources().get("GPU", 0)
            stop, tally = asyncio.Event(), Tally()
            tasks = [asyncio.create_task(trajectory(
                c, f"r{i}", MODEL, stop, tally, max_tokens=400,
                extra={"ignore_eos": True})) for i in range(10)]
            on_tp4 = 0
            for _ in range(300):  # resize while calls run on the TP4 instance
                on_tp4 = next(b["in_flight"] for b in (await c.get(
                    "/admin/backends", headers=ADMIN)).json()["data"] if b["tp"] == 4)
                if on_tp4:
                    break
                await asyncio.sleep(0.05)
            r = await c.put("/admin/pool", json={"gpus": 4}, headers=ADMIN)
            resize = await wait_job(c, r.json()["job"], 120)
            stop.set()
            await asyncio.gather(*tasks)
            after = (await c.get("/admin/pool", headers=ADMIN)).json()
            gpus_freed = ray_cluster.available_resources().get("GPU", 0)
            calls = await calls_of(c, tally.trajectories)
    print("reconfiguration times (Ray, sim actors): initial", initial["duration_s"],
          "resize to 4 GPUs", resize["duration_s"],
          {p["name"]: p["duration_s"] for p in resize["phases"]})
    assert sorted((i["id"], i["state"]) for i in pool["instances"]) == sorted(
        [(f"tp1-g{g}", "ready") for g in range(4)] + [("tp4-g4-5-6-7", "ready")])
    assert gpus_left == 0
    assert resize["status"] == "succeeded", resize
    assert resize["plan"]["stop"] == ["tp4-g4-5-6-7"] and resize["plan"]["start"] == []
    assert on_tp4 > 0  # calls were running on the instance that was removed
    drain = next(p for p in resize["phases"] if p["name"] == "drain")
    assert drain["in_flight"]["tp4-g4-5-6-7"] > 0 and "forced" not in drain
    assert tally.failed == []
    assert [i["id"] for i in after["instances"]] == [f"tp1-g{g}" for g in range(4)]
    assert gpus_freed == 4
    assert {call["tp"] for call in calls} == {1, 4}
    assert all(call["status"] == "ok" for call in calls)
