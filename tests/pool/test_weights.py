"""The pool's weights: one record, every engine it starts comes up on them, updates are
checked before anything pauses, an update with no engine applies to the next ones,
pushed weights hold new engines back until an update brings them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from backends.sim_launcher import SimLauncher
from gateway.pool.checkpoint import check_checkpoint
from tests.pool.conftest import ADMIN, PoolGateway
from tests.pool.test_pool_sim import MODEL, client, ready_pool, reconfigure, sim_spec
from tests.pool.workload import wait_job

HI = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def checkpoint(root: Path, name: str) -> str:
    """A directory with what a checkpoint needs (the simulated server loads nothing)."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


async def update(c: httpx.AsyncClient, version: str, path: str | None = None,
                 done: bool = False) -> dict[str, Any]:
    """A weight update job (reload from ``path``, or pushed and reported done)."""
    body = ({"version": version, "method": "reload", "weights_path": path} if path
            else {"version": version, "method": "external"})
    r = await c.post("/admin/weight-update", json=body, headers=ADMIN)
    assert r.status_code == 202, r.text
    if done:
        for _ in range(100):  # reported as soon as the engines are paused
            job = (await c.get(f"/admin/jobs/{r.json()['job']}", headers=ADMIN)).json()
            if any(p["name"] == "update" for p in job["phases"]) or job["status"] != "running":
                break
            await asyncio.sleep(0.05)
        await c.post(f"/admin/weight-update/{r.json()['job']}/done", headers=ADMIN)
    return await wait_job(c, r.json()["job"], 60)


async def engines(c: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """Each instance as the pool lists it, with what its engine says it serves."""
    pool = (await c.get("/admin/pool", headers=ADMIN)).json()
    out = {}
    for inst in pool["instances"]:
        if inst["url"] is not None and inst["state"] in ("ready", "starting"):
            try:
                inst["info"] = (await c.get(f"{inst['url']}/weight_info")).json()
                inst["stats"] = (await c.get(f"{inst['url']}/sim/stats")).json()
            except httpx.ConnectError:  # crashed, and the pool has not noticed yet
                inst["state"] = "gone"
        out[inst["id"]] = inst
    return out


async def until(check: Any, timeout_s: float = 20) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


def assert_serving(found: dict[str, dict[str, Any]], version: str, path: str) -> None:
    for inst in found.values():
        assert inst["state"] == "ready", inst
        assert inst["weight_version"] == version, inst
        assert inst["info"] == {"weight_version": version}, inst
        assert inst["stats"]["weights_path"] == path, inst  # what it loaded


async def test_every_engine_the_pool_starts_comes_up_on_the_current_weights(
        pool_gateway: PoolGateway, tmp_path: Path) -> None:
    spec = sim_spec(gpus=4, layout=[{"tp": 1, "count": 2}])
    with pool_gateway(spec) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            assert {i["info"]["weight_version"] for i in (await engines(c)).values()} == {"0"}
            for v in ("1", "2"):
                path = checkpoint(tmp_path, f"step-{v}")
                job = await update(c, v, path)
                assert job["status"] == "succeeded", job
            pool = (await c.get("/admin/pool", headers=ADMIN)).json()
            assert pool["weights"] == {"version": "2", "path": path, "pushed": False}
            assert_serving(await engines(c), "2", path)
            # scale up, relayout (TP1+TP1 -> TP2), crash restart: all on step-2, as "2"
            r = await c.post("/admin/backends", json={"tp": 1}, headers=ADMIN)
            assert (await wait_job(c, r.json()["job"], 30))["status"] == "succeeded"
            await reconfigure(c, {"layout": [{"tp": 2, "gpus": [0, 1]}, {"tp": 1}]})
            assert_serving(await engines(c), "2", path)
            victim = next(iter(gw.rt.pool.instances.values()))  # type: ignore[union-attr]
            launcher = gw.rt.pool.launcher  # type: ignore[union-attr]
            assert isinstance(launcher, SimLauncher) and victim.launched is not None
            gw.loop.run(launcher.crash(victim.launched))

            async def restarted() -> bool:
                found = await engines(c)
                inst = found[victim.spec.id]
                return inst["restarts"] == 1 and inst["state"] == "ready"

            await until(restarted)
            assert_serving(await engines(c), "2", path)
            answer = await c.post("/v1/chat/completions", json=HI,
                                  headers={"x-trajectory-id": "after"})
            assert answer.status_code == 200
            (call,) = (await c.get("/trajectories/after", headers=ADMIN)).json()["calls"]
    assert call["weight_version"] == "2" and call["weight_segments"] is None


async def test_a_bad_update_pauses_nothing_and_changes_nothing(
        pool_gateway: PoolGateway, tmp_path: Path) -> None:
    with pool_gateway(sim_spec(gpus=2)) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            before = await engines(c)
            no_config = tmp_path / "no-config"
            no_config.mkdir()
            (no_config / "model.safetensors").write_bytes(b"")
            bad = {"missing": (str(tmp_path / "nope"), "does not exist"),
                   "relative": ("step-1", "not absolute"),
                   "no config": (str(no_config), "no config.json"),
                   "no weights": (str(tmp_path), "no weight files")}
            dry = {name: await c.post("/admin/weight-update", params={"dry_run": "true"},
                                      headers=ADMIN, json={"version": "9", "method": "reload",
                                                           "weights_path": path})
                   for name, (path, _) in bad.items()}
            good = await c.post("/admin/weight-update", params={"dry_run": "true"},
                                headers=ADMIN, json={"version": "9", "method": "reload",
                                                     "weights_path": checkpoint(tmp_path, "ok")})
            unchecked = (await c.get("/admin/jobs", headers=ADMIN)).json()["data"]
            jobs = {name: await update(c, "9", path) for name, (path, _) in bad.items()}
            after = await engines(c)
            ok = await c.post("/v1/chat/completions", json=HI)
    for name, answer in dry.items():  # the dry run says what the job's check would
        assert answer.status_code == 400 and bad[name][1] in answer.text, answer.text
    assert good.status_code == 200 and sorted(good.json()["engines"]) == sorted(before)
    assert not [j for j in unchecked if j["kind"] == "weight-update"]  # none started
    for name, job in jobs.items():
        assert job["status"] == "failed", job
        assert [p["name"] for p in job["phases"]] == ["check"], job
        assert bad[name][1] in " ".join(job["errors"]), job["errors"]
        assert "nothing was paused" in job["errors"][-1]
    for iid, inst in after.items():  # never paused, never reloaded, still serving "0"
        assert inst["stats"]["pauses"] == before[iid]["stats"]["pauses"] == 0
        assert inst["stats"]["reloads"] == 0 and inst["info"]["weight_version"] == "0"
    assert gw.rt.weight_version == "0" and ok.status_code == 200


async def test_an_update_with_no_engine_applies_to_the_engines_started_next(
        pool_gateway: PoolGateway, tmp_path: Path) -> None:
    with pool_gateway(sim_spec(gpus=2, layout=[{"tp": 1}])) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            await reconfigure(c, {"gpus": 0})
            dry = await c.post("/admin/weight-update", params={"dry_run": "true"},
                               headers=ADMIN, json={"version": "5"})
            pushed = await update(c, "5", done=True)
            path = checkpoint(tmp_path, "step-5")
            job = await update(c, "5", path)
            await reconfigure(c, {"gpus": 2})
            found = await engines(c)
    assert pushed["status"] == "failed" and "no engine to update" in pushed["errors"][0]
    assert dry.status_code == 409 and "no engine to update" in dry.text
    assert job["status"] == "succeeded", job
    assert [p["name"] for p in job["phases"]] == ["check"]
    assert "engines start on these weights" in job["phases"][0]["note"]
    assert len(found) == 2
    assert_serving(found, "5", path)
    assert gw.rt.weight_version == "5"


async def test_pushed_weights_hold_a_new_engine_until_an_update_brings_them(
        pool_gateway: PoolGateway) -> None:
    with pool_gateway(sim_spec(gpus=2, layout=[{"tp": 1}])) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            job = await update(c, "7", done=True)
            assert job["status"] == "succeeded", job
            r = await c.post("/admin/backends", json={"tp": 1}, headers=ADMIN)
            added = await wait_job(c, r.json()["job"], 30)
            held = await engines(c)
            backends = (await c.get("/admin/backends", headers=ADMIN)).json()["data"]
            served = await c.post("/v1/chat/completions", json=HI,
                                  headers={"x-trajectory-id": "meanwhile"})
            job = await update(c, "8", done=True)  # the trainer pushes to both engines
            found = await engines(c)
            calls = (await c.get("/trajectories/meanwhile", headers=ADMIN)).json()["calls"]
    new = "tp1-g1"
    assert added["status"] == "succeeded"
    assert held[new]["state"] == "starting" and held[new]["awaiting_weights"] == "7"
    assert held[new]["info"] == {"weight_version": "default"}  # never told: not admitted
    assert [b["id"] for b in backends] == ["tp1-g0"]
    assert served.status_code == 200 and calls[0]["backend_id"] == "tp1-g0"
    assert job["status"] == "succeeded"
    assert sorted(job["phases"][0]["engines"]) == ["tp1-g0", new]
    for inst in found.values():
        assert inst["state"] == "ready" and inst["info"] == {"weight_version": "8"}
        assert inst["awaiting_weights"] is None
    assert gw.rt.pool is not None and gw.rt.pool.weights.pushed



def test_a_checkpoint_needs_its_config_its_weights_and_every_shard(tmp_path: Path) -> None:
    path = Path(checkpoint(tmp_path, "sharded"))
    assert check_checkpoint(str(path)) == []
    (path / "model.safetensors").unlink()
    (path / "model-00001-of-00002.safetensors").write_bytes(b"")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (problem,) = check_checkpoint(str(path))
    assert "missing shards ['model-00002-of-00002.safetensors']" in problem
    (path / "model.safetensors.index.json").write_text("{")
    assert "unreadable index" in check_checkpoint(str(path))[0]


async def test_engines_the_pool_starts_load_its_lora_adapters_before_they_serve(
        pool_gateway: PoolGateway, tmp_path: Path) -> None:
    """A LoRA update (``method: "lora"``) is kept like full weights: an engine added by a
    resize or restarted after a crash loads every adapter the others hold before it is
    admitted, so a call sent to it runs on the current adapter, not a 404."""
    from backends.tinylora import write_adapter

    spec = sim_spec(gpus=3, layout=[{"tp": 1, "count": 2}])
    spec["launcher"]["lora"] = {"max_rank": 16}
    with pool_gateway(spec) as gw:
        async with client(gw) as c:
            await ready_pool(c)
            for v in ("1", "2"):
                r = await c.post("/admin/weight-update", json={
                    "version": v, "method": "lora",
                    "lora_path": str(write_adapter(tmp_path / f"a{v}", seed=int(v)))})
                assert r.status_code == 202, r.text
                assert (await wait_job(c, r.json()["job"], 30))["status"] == "succeeded"
            r = await c.post("/admin/backends", json={"tp": 1}, headers=ADMIN)
            assert (await wait_job(c, r.json()["job"], 30))["status"] == "succeeded"
            victim = next(iter(gw.rt.pool.instances.values()))  # type: ignore[union-attr]
            launcher = gw.rt.pool.launcher  # type: ignore[union-attr]
            assert isinstance(launcher, SimLauncher) and victim.launched is not None
            gw.loop.run(launcher.crash(victim.launched))

            async def restarted() -> bool:
                inst = (await engines(c))[victim.spec.id]
                return inst["restarts"] == 1 and inst["state"] == "ready"

            await until(restarted)
            found = await engines(c)
            assert len(found) == 3
            for inst in found.values():  # the added one and the restarted one too
                assert inst["stats"]["adapters"] == [f"{MODEL}@lora-1", f"{MODEL}@lora-2"]
            for i in range(6):  # every engine serves calls on adapter 2
                answer = await c.post("/v1/chat/completions", json=HI,
                                      headers={"x-trajectory-id": f"after-{i}"})
                assert answer.status_code == 200, answer.text
                assert answer.json()["model"] == f"{MODEL}@lora-2"
