"""GPUs handed from one managed pool to another (what a move between shards does): the
giving pool drains and stops the instance and forgets its GPUs, the taking pool adds
them and starts an instance of the same TP; no call fails, no GPU is held twice, and
every bad request is refused before anything stops."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.shards.moves import MoveRefused, begin_move
from gateway.shards.shardset import Front
from gateway.store.db import upgrade
from tests.pool.conftest import ADMIN, Gateway, pool_settings
from tests.pool.test_pool_sim import MODEL, client, ready_pool, sim_spec
from tests.pool.workload import Tally, calls_of, trajectory, wait_job
from tests.servers import LoopThread, app_in_thread


@pytest.fixture
def dbs(tmp_path: Path) -> dict[str, str]:
    out = {n: f"sqlite+aiosqlite:///{tmp_path / f'{n}.db'}" for n in "ab"}
    for url in out.values():
        upgrade(url)
    return out


@contextmanager
def two_pools(loop_thread: LoopThread, tmp_path: Path,
              dbs: dict[str, str]) -> Iterator[tuple[Gateway, Gateway]]:
    """Pool A on GPUs 0-3, pool B on 4-7, as `serve --shards 2` splits an 8-GPU pool."""
    gws = []
    with ExitStack() as stack:
        for name, gpus in (("a", [0, 1, 2, 3]), ("b", [4, 5, 6, 7])):
            spec = {**sim_spec(), "inventory": {"gpus": gpus}, "layout": [{"tp": 1, "count": 4}]}
            path = tmp_path / f"pool-{name}.json"
            path.write_text(json.dumps(spec))
            app = create_app(pool_settings(path, dbs[name]))
            url = stack.enter_context(app_in_thread(loop_thread, lambda app=app: app))
            gws.append(Gateway(url, app, loop_thread))
        yield gws[0], gws[1]


async def _job(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await c.post(path, json=body, headers=ADMIN)
    assert r.status_code == 202, r.text
    return await wait_job(c, r.json()["job"], 60)


async def test_an_instance_moves_its_gpus_to_another_pool_under_traffic(
        loop_thread: LoopThread, tmp_path: Path, dbs: dict[str, str]) -> None:
    with two_pools(loop_thread, tmp_path, dbs) as (a, b):
        async with client(a) as ca, client(b) as cb:
            await ready_pool(ca)
            await ready_pool(cb)
            stop, tally = asyncio.Event(), Tally()
            tasks = [asyncio.create_task(trajectory(c, f"{n}{i}", MODEL, stop, tally))
                     for c, n in ((ca, "a"), (cb, "b")) for i in range(6)]
            await asyncio.sleep(0.3)
            job = await _job(ca, "/admin/pool/release", {"id": "tp1-g3"})
            assert job["status"] == "succeeded", job
            assert job["request"] == {"id": "tp1-g3", "gpus": [3], "tp": 1}
            assert job["plan"]["stop"] == ["tp1-g3"] and job["plan"]["start"] == []
            pool_a = (await ca.get("/admin/pool", headers=ADMIN)).json()
            assert pool_a["inventory"] == [{"node": "local", "gpus": [0, 1, 2]}]
            r = await ca.put("/admin/pool?dry_run=true", json={"gpus": 2}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["planned"] == ["tp1-g0", "tp1-g1"]
            assert (await ca.get("/admin/pool", headers=ADMIN)).json()["planned"] == [
                "tp1-g0", "tp1-g1", "tp1-g2"]  # a dry run changes nothing
            assert [i["id"] for i in pool_a["instances"]] == ["tp1-g0", "tp1-g1", "tp1-g2"]
            # pool A cannot take GPU 3 back by a resize: it is no longer its own
            r = await ca.put("/admin/pool", json={"gpus": 4}, headers=ADMIN)
            assert r.status_code == 400 and "between 0 and 3" in r.text
            r = await ca.put("/admin/pool", json={"gpus": [0, 3]}, headers=ADMIN)
            assert r.status_code == 400 and "not in the inventory" in r.text

            job = await _job(cb, "/admin/pool/adopt", {"gpus": [3], "tp": 1})
            assert job["status"] == "succeeded", job
            assert job["plan"]["start"] == ["tp1-g3"] and len(job["plan"]["keep"]) == 4
            pool_b = (await cb.get("/admin/pool", headers=ADMIN)).json()
            assert pool_b["inventory"] == [{"node": "local", "gpus": [4, 5, 6, 7, 3]}]
            assert {i["id"]: i["state"] for i in pool_b["instances"]}["tp1-g3"] == "ready"
            # trajectories stay on their engines (prefix cache): new ones reach GPU 3
            tasks += [asyncio.create_task(trajectory(cb, f"b{i}", MODEL, stop, tally))
                      for i in range(6, 12)]
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*tasks)
            assert tally.failed == [], tally.failed
            on_b = [c["backend_id"] for c in await calls_of(
                cb, {t for t in tally.trajectories if t.startswith("b")})]
            on_a = [c["backend_id"] for c in await calls_of(
                ca, {t for t in tally.trajectories if t.startswith("a")})]
            assert "tp1-g3" in on_b, sorted(set(on_b))
            assert "tp1-g3" in on_a  # it served A before it drained: none of those failed
            print(f"handover under traffic: {tally.ok} calls, none failed; B's calls on "
                  f"GPU 3: {on_b.count('tp1-g3')}, A's before the release: "
                  f"{on_a.count('tp1-g3')}")


async def test_bad_handovers_are_refused_before_anything_stops(
        loop_thread: LoopThread, tmp_path: Path, dbs: dict[str, str]) -> None:
    with two_pools(loop_thread, tmp_path, dbs) as (a, b):
        async with client(a) as ca, client(b) as cb:
            await ready_pool(ca)
            await ready_pool(cb)
            cases = [
                (ca, "/admin/pool/release", {"id": "tp1-g9"}, 404, "no instance 'tp1-g9'"),
                (ca, "/admin/pool/release", {}, 422, "id"),
                (cb, "/admin/pool/adopt", {"gpus": [4]}, 409, "already this pool's"),
                (cb, "/admin/pool/adopt", {"gpus": [8, 9], "tp": 1}, 400, "tp=1 needs 1"),
                (cb, "/admin/pool/adopt", {"gpus": [8, 8]}, 400, "each once"),
                (cb, "/admin/pool/adopt", {"gpus": ["n1:8", "n2:9"]}, 400, "one node"),
                (cb, "/admin/pool/adopt", {"gpus": []}, 422, "gpus"),
                (cb, "/admin/pool/adopt", {"gpus": ["x:y"]}, 400, "'node:id'"),
            ]
            for c, path, body, code, text in cases:
                r = await c.post(path, json=body, headers=ADMIN)
                assert r.status_code == code and text in r.text, (path, body, r.text)
                assert r.json()["detail"], r.text  # the admin API's error shape
            async with httpx.AsyncClient(base_url=b.url) as anonymous:
                r = await anonymous.post("/admin/pool/adopt", json={"gpus": [8]})
                assert r.status_code == 401, r.text
            for gid in (1, 2, 3):  # a pool keeps its last instance
                job = await _job(ca, "/admin/pool/release", {"id": f"tp1-g{gid}"})
                assert job["status"] == "succeeded", job
            r = await ca.post("/admin/pool/release", json={"id": "tp1-g0"}, headers=ADMIN)
            assert r.status_code == 409 and "last instance" in r.text
            for c, n in ((ca, 1), (cb, 4)):  # nothing else changed
                pool = (await c.get("/admin/pool", headers=ADMIN)).json()
                assert len(pool["instances"]) == n, pool
                assert all(i["state"] == "ready" for i in pool["instances"])


async def _front_job(front: Front, job_id: str) -> dict[str, Any]:
    view = front.jobs[job_id].own
    assert view is not None
    for _ in range(600):
        if view["status"] != "running":
            return view
        await asyncio.sleep(0.1)
    raise AssertionError(f"move {job_id} still running: {view}")


async def test_the_fronts_move_gives_gpus_back_when_the_taker_refuses_them(
        loop_thread: LoopThread, tmp_path: Path, dbs: dict[str, str]) -> None:
    """The sharded front's move job over two real pools: a refused adopt puts the GPUs
    back on the shard they came from; two moves at once are one too many; a shard's last
    engine stays."""
    with two_pools(loop_thread, tmp_path, dbs) as (a, b):
        async with client(a) as ca, client(b) as cb:
            await ready_pool(ca)
            await ready_pool(cb)
            # B already claims GPU 3 (an operator's mistake): it will refuse A's GPU 3
            assert (await _job(cb, "/admin/pool/adopt", {"gpus": [3]}))["status"] == "succeeded"
            front = Front([a.url, b.url], "admin-secret")
            try:
                job = await begin_move(front, 0, "tp1-g3", 1, front.admin, reason="test")
                with pytest.raises(MoveRefused) as busy:  # one at a time
                    await begin_move(front, 0, "tp1-g2", 1, front.admin, reason="test")
                assert busy.value.status == 409 and "one at a time" in str(busy.value.detail)
                view = await _front_job(front, job.id)
                assert view["status"] == "failed", view
                assert [(p["name"], p["status"]) for p in view["phases"]] == [
                    ("release", "succeeded"), ("adopt", "refused"), ("give-back", "succeeded")]
                assert view["errors"][0].startswith("shard 1: 409") and \
                    "are already this pool's" in view["errors"][0], view["errors"]
                pool_a = (await ca.get("/admin/pool", headers=ADMIN)).json()
                assert sorted(g for n in pool_a["inventory"] for g in n["gpus"]) == [0, 1, 2, 3]
                assert {i["id"]: i["state"] for i in pool_a["instances"]}["tp1-g3"] == "ready"
                for gid in (3, 2, 1):  # A gives all but its last engine away
                    await ca.post("/admin/pool/release", json={"id": f"tp1-g{gid}"},
                                  headers=ADMIN)
                deadline = time.monotonic() + 30
                while len((await ca.get("/admin/backends", headers=ADMIN)).json()["data"]) > 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                with pytest.raises(MoveRefused) as last:
                    await begin_move(front, 0, "tp1-g0", 1, front.admin, reason="test")
                assert last.value.status == 409 and "last serving engine" in last.value.detail
                assert front.moving is None
            finally:
                await front.close()
