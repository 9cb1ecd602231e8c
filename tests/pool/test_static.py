"""Static pools (external URLs) and plain ``--backend`` backends: never reconfigured,
but removal still drains first."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from backends.base import InstanceSpec
from backends.sim_launcher import SimLauncher
from gateway.app import create_app
from gateway.config import Settings
from tests.pool.conftest import ADMIN, PoolGateway
from tests.pool.test_pool_sim import MODEL, client
from tests.pool.workload import wait_job
from tests.servers import LoopThread, app_in_thread


@pytest.fixture(scope="module")
def external(loop_thread: LoopThread) -> Iterator[str]:
    launcher = SimLauncher(speed=50)
    inst = loop_thread.run(launcher.start(InstanceSpec(id="ext", model=MODEL)))
    yield inst.url
    loop_thread.run(launcher.close())


async def test_static_pool_registers_urls_and_refuses_reconfiguration(
        pool_gateway: PoolGateway, external: str) -> None:
    spec = {"model": MODEL, "launcher": {"kind": "static",
                                         "backends": [{"url": external, "tp": 2, "id": "a"}]}}
    with pool_gateway(spec) as gw:
        async with client(gw) as c:
            assert (await wait_job(c, "1", 10))["status"] == "succeeded"
            backends = (await c.get("/admin/backends", headers=ADMIN)).json()["data"]
            refused = await c.put("/admin/pool", json={"gpus": 2}, headers=ADMIN)
            added = await c.post("/admin/backends", json={"tp": 1}, headers=ADMIN)
            removed = await c.delete("/admin/backends/a", headers=ADMIN)
            job = await wait_job(c, removed.json()["job"], 10)
            left = (await c.get("/admin/backends", headers=ADMIN)).json()["data"]
    assert [(b["id"], b["tp"], b["source"]) for b in backends] == [("a", 2, "static")]
    assert refused.status_code == 400 and "static" in refused.json()["detail"]
    assert added.status_code == 400
    assert removed.status_code == 202 and job["status"] == "succeeded"
    assert left == []


def test_unmanaged_backend_removal_drains_then_removes(
        loop_thread: LoopThread, sqlite_url: str, external: str) -> None:
    settings = Settings(database_url=sqlite_url, backends=[f"{external}#tp=2"])
    with app_in_thread(loop_thread, lambda: create_app(settings)) as url:
        r = httpx.delete(f"{url}/admin/backends/b0")
        job = {"status": "pending"}
        while job["status"] in ("pending", "running"):
            job = httpx.get(f"{url}/admin/jobs/{r.json()['job']}").json()
        backends = httpx.get(f"{url}/admin/backends").json()["data"]
        pool = httpx.get(f"{url}/admin/pool").json()
        missing = httpx.delete(f"{url}/admin/backends/nope")
        no_pool = httpx.put(f"{url}/admin/pool", json={"gpus": 1})
    assert r.status_code == 202 and r.json()["draining"] is True
    assert job["kind"] == "remove-backend" and job["phases"][0]["name"] == "drain"
    assert job["status"] == "succeeded" and backends == []
    assert pool["managed"] is False
    assert missing.status_code == 404
    assert no_pool.status_code == 409
