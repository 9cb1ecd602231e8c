"""``rollout-gateway serve --shards N`` as users start it: HAProxy in front of N gateway
processes and the front, simulated vLLM servers behind, one Postgres store.

The same seeded batch gives the same training samples through one process, two shards
and three; a trajectory stays on one shard whatever mix of tags its calls carry; the
admin API reaches every shard and is undone where it applied when one shard fails; a
shard killed mid-batch fails its own calls with an error, not a hang, and no other
shard's."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from gateway.client import RolloutClient
from tests.shards.conftest import (
    agent,
    batch_ids,
    gateway,
    haproxy_or_fail,
    run_batch,
    samples,
)

pytestmark = pytest.mark.postgres


def test_one_two_and_three_shards_give_the_same_samples(sim_servers: list[str],
                                                        tmp_path: Path) -> None:
    haproxy_or_fail()
    ids = batch_ids()
    got = {}
    for shards in (1, 2, 3):
        with gateway(sim_servers, shards, tmp_path) as (url, _):
            asyncio.run(run_batch(url, ids))
            got[shards] = samples(url, ids)
            status = httpx.get(f"{url}/status", timeout=30).json()
            if shards > 1:
                assert [s["ok"] for s in status["shards"]] == [True] * shards
                served = [sum(b["served"] for b in status["backends"] if b["shard"] == i)
                          for i in range(shards)]
                assert all(n > 0 for n in served), served  # every shard took a share
                assert status["totals"]["calls"] == 3 * sum(len(t) for t in ids.values())
                for tid in (t for tids in ids.values() for t in tids):
                    _owner(url, shards, tid)  # a trajectory lives on one shard
    assert len(got[1]) == 18
    for tid, one in got[1].items():
        assert one["mismatches"] == [] and sum(one["loss_mask"]) > 0
        assert got[2][tid] == one and got[3][tid] == one, tid


#: the ways a harness may tag one trajectory's calls, mixed call by call
TAGS = [lambda g, t: (f"/g/{g}/t/{t}/v1/chat/completions", {}),
        lambda g, t: (f"/t/{t}/v1/chat/completions", {}),
        lambda g, t: ("/v1/chat/completions", {"X-Trajectory-Id": t, "X-Group-Id": g}),
        lambda g, t: (f"/t/{t}/v1/chat/completions", {"X-Group-Id": g})]


def test_a_trajectory_that_mixes_its_tags_stays_on_one_shard(sim_servers: list[str],
                                                              tmp_path: Path) -> None:
    """With and without its group in the path, or by header, call after call: every call
    reaches the shard that holds the trajectory, so its calls are numbered once (no
    ``(attempt, seq)`` twice) and its sample holds them all."""
    gid, tids, turns = "grp-mix", [f"mix-{k}" for k in range(6)], 2 * len(TAGS)

    async def one(http: httpx.AsyncClient, tid: str) -> None:
        messages: list[dict[str, object]] = [{"role": "user", "content": "task of grp-mix"}]
        for turn in range(turns):
            path, headers = TAGS[turn % len(TAGS)](gid, tid)
            r = await http.post(path, headers=headers, json={
                "model": "qwen3-14b", "messages": messages, "max_tokens": 8,
                "seed": turn, "ignore_eos": True})
            r.raise_for_status()
            messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]
                          ["content"]}, {"role": "user", "content": f"tool result {turn}"}]
        (await http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0})
         ).raise_for_status()

    async def batch(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await asyncio.gather(*(one(http, t) for t in tids))

    with gateway(sim_servers, 2, tmp_path) as (url, _):
        asyncio.run(batch(url))
        owners = {_owner(url, 2, t) for t in tids}
        for tid in tids:
            calls = httpx.get(f"{url}/trajectories/{tid}", timeout=30).json()["calls"]
            assert sorted((c["attempt"], c["seq"]) for c in calls) == [
                (0, i) for i in range(turns)], (tid, calls)
            s = samples(url, {gid: [tid]})[tid]
            assert s["group_id"] == gid and s["mismatches"] == [], s
            assert sum(s["loss_mask"]) >= turns * 8 - turns, s  # every call's tokens
        print(f"{len(tids)} trajectories, {turns} calls each in 4 forms, on shards {owners}")


def _owner(url: str, shards: int, tid: str) -> int:
    status = httpx.get(f"{url}/status", timeout=30).json()
    shard_urls = [s["url"] for s in status["shards"]]
    held = [i for i, u in enumerate(shard_urls)
            if httpx.get(f"{u}/trajectories/{tid}/live", timeout=10).status_code == 200]
    assert len(held) == 1, (tid, held)
    return held[0]


def test_admin_reaches_every_shard_and_is_undone_when_one_fails(
        sim_servers: list[str], tmp_path: Path) -> None:
    with gateway(sim_servers, 2, tmp_path) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/admin/pause")
        assert r.status_code == 200 and [s["body"]["paused"] for s in r.json()["shards"]] \
            == [True, True]
        assert http.get("/status").json()["paused"] is True
        r = http.post("/admin/resume", json={"weight_version": "7"})
        assert r.status_code == 200
        status = http.get("/status").json()
        assert status["weight_version"] == "7" and status["paused"] is False
        assert http.put("/admin/policy", json={"policy": "nope"}).status_code == 400
        r = http.put("/admin/policy", json={"policy": "libra"})
        assert r.status_code == 200 and http.get("/status").json()["policy"] == "libra"
        # a weight update through the front: one job per shard under one id, the
        # trainer's push between every shard's pause and resume
        pushed = []
        with RolloutClient(url) as gw:
            job = gw.update_weights("9", push=lambda: pushed.append(time.monotonic()),
                                    mode="abort-and-continue", timeout_s=120)
        assert job.status == "succeeded" and len(pushed) == 1, job
        assert job.id.startswith("f") and len(job.raw["shards"]) == 2
        status = http.get("/status").json()
        assert [s["weight_version"] for s in status["shards"]] == ["9", "9"]
        # a weight update one shard would refuse (one runs there already) starts on none:
        # every shard dry-runs it first
        shard_urls = [s["url"] for s in status["shards"]]
        own = httpx.post(f"{shard_urls[1]}/admin/weight-update", timeout=30,
                         json={"version": "10", "timeout_s": 2}).json()["job"]
        r = http.post("/admin/weight-update", json={"version": "11"})
        assert r.status_code == 409 and r.json()["applied"] is False, r.text
        assert "already running" in r.text
        jobs = httpx.get(f"{shard_urls[0]}/admin/jobs", timeout=30).json()["data"]
        assert not [j for j in jobs if j["kind"] == "weight-update"
                    and j["request"].get("version") == "11"], jobs
        r = http.post("/admin/weight-update", json={"version": "11", "method": "reload",
                                                    "weights_path": "/no/such/checkpoint"})
        assert r.status_code in (400, 409) and r.json()["applied"] is False, r.text
        deadline = time.monotonic() + 30  # shard 1's own update: no push came, abandoned
        while httpx.get(f"{shard_urls[1]}/admin/jobs/{own}", timeout=30).json()[
                "status"] not in ("failed", "succeeded"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status = http.get("/status").json()
        assert [s["weight_version"] for s in status["shards"]] == ["9", "9"]
        # two updates at once through the front: one starts, on every shard; the other is
        # refused (each could pass every shard's check, then start on different shards)
        front = asyncio.run(_at_once(url, [{"version": v, "timeout_s": 2}
                                           for v in ("12", "13")]))
        assert sorted(r.status_code for r in front) == [202, 409], [r.text for r in front]
        started = [{j["request"]["version"] for j in httpx.get(
            f"{u}/admin/jobs", timeout=30).json()["data"] if j["kind"] == "weight-update"
            and j["request"].get("version") in ("12", "13")} for u in shard_urls]
        assert started[0] == started[1] and len(started[0]) == 1, started
        job = next(r.json()["job"] for r in front if r.status_code == 202)
        deadline = time.monotonic() + 30  # no push comes: abandoned on every shard
        while http.get(f"/admin/jobs/{job}").json()["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        status = http.get("/status").json()
        assert [s["weight_version"] for s in status["shards"]] == ["9", "9"]
        # shard 1 is gone when the next version change comes: shard 0's is undone
        os.kill(_pid_on(status["shards"][1]["url"]), signal.SIGKILL)
        t0 = time.monotonic()
        r = http.put("/admin/weight-version", json={"version": "8"})
        assert r.status_code == 502, r.text
        report = r.json()
        assert report["rolled_back"] == [0]
        assert report["shards"][0]["status"] == 200
        assert http.get("/status").json()["weight_version"] == "9"  # as before
        print(f"one shard killed: the version change failed in "
              f"{time.monotonic() - t0:.1f} s and was undone on shard 0")
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"


async def _at_once(url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    """``POST /admin/weight-update`` with each body, all at once."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return list(await asyncio.gather(*(http.post("/admin/weight-update", json=b)
                                           for b in bodies)))


def _pid_on(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    import subprocess

    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split("pid=")[1].split(",")[0])


def test_a_killed_shard_fails_its_own_calls_and_no_others(sim_servers: list[str],
                                                         tmp_path: Path) -> None:
    ids = batch_ids(groups=8, size=2)
    with gateway(sim_servers, 2, tmp_path) as (url, _):
        status = httpx.get(f"{url}/status", timeout=30).json()
        victim = status["shards"][1]["url"]

        async def go() -> dict[str, object]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                async def one(gid: str, tid: str) -> object:
                    try:
                        return await agent(http, gid, tid, turns=8, tokens=400)
                    except httpx.HTTPError as exc:
                        return exc
                tasks = {t: asyncio.create_task(one(g, t)) for g, ts in ids.items()
                         for t in ts}
                async with httpx.AsyncClient(timeout=10) as probe:
                    while not (await probe.get(f"{victim}/status")).json()["pool"]["running"]:
                        await asyncio.sleep(0.05)  # kill it with calls in flight
                os.kill(_pid_on(victim), signal.SIGKILL)
                return {t: await task for t, task in tasks.items()}

        t0 = time.monotonic()
        results = asyncio.run(go())
        wall = time.monotonic() - t0
        failed = {t for t, r in results.items() if isinstance(r, Exception)}
        ok = set(results) - failed
        assert failed, "the killed shard's trajectories should have failed"
        assert ok, "the other shard's trajectories should have finished"
        for exc in (results[t] for t in failed):
            assert isinstance(exc, httpx.HTTPStatusError), exc  # an answer, not a hang
            assert exc.response.status_code >= 500
        survivors = samples(url, {"ok": sorted(ok)})
        for tid, s in survivors.items():
            assert s["mismatches"] == [] and sum(s["loss_mask"]) > 0, tid
        survivor = status["shards"][0]["url"]
        for tid in ok:  # the finished ones were the surviving shard's
            assert httpx.get(f"{survivor}/trajectories/{tid}/live",
                             timeout=10).status_code == 200, tid
        print(f"killed shard: {len(failed)} trajectories failed with 5xx, {len(ok)} "
              f"finished exactly, in {wall:.1f} s")


def test_a_backend_moves_between_shards_and_calls_follow(sim_servers: list[str],
                                                         tmp_path: Path) -> None:
    """Rebalancing moves an instance (drained off one shard, registered on the other),
    never a trajectory; bad move requests get a 4xx saying why."""
    with gateway(sim_servers, 2, tmp_path) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as http:
        rows = http.get("/admin/backends").json()["data"]
        assert sorted(r["shard"] for r in rows) == [0, 0, 0, 1, 1, 1]
        mover = next(r for r in rows if r["shard"] == 0)
        shard, bid = mover["id"].split("/")
        assert shard == "s0"
        for bad, code in [({"to": 0}, 422), ({"to": 2}, 422), ({"to": "1"}, 422),
                          ({}, 422)]:
            r = http.post(f"/admin/backends/s0/{bid}/move", json=bad)
            assert r.status_code == code and "'to' must be another shard" in r.text, bad
        r = http.post(f"/admin/backends/s0/{bid}/move", content=b"{nope",
                      headers={"content-type": "application/json"})
        assert r.status_code == 422 and "not JSON" in r.text
        assert http.post("/admin/backends/s0/b999/move", json={"to": 1}).status_code == 404
        r = http.post(f"/admin/backends/s7/{bid}/move", json={"to": 1})
        assert r.status_code == 404 and "no shard '7'" in r.text
        assert http.delete("/admin/backends/sx/b1").status_code == 404

        r = http.post(f"/admin/backends/s0/{bid}/move", json={"to": 1})
        assert r.status_code == 202, r.text
        job_url = r.json()["url"]
        deadline = time.monotonic() + 60
        while (job := http.get(job_url).json())["status"] == "running":
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
        assert job["status"] == "succeeded", job
        assert [p["name"] for p in job["phases"]] == ["drain", "register"]
        after = http.get("/admin/backends").json()["data"]
        owners = {r["url"]: r["shard"] for r in after}
        assert owners[mover["url"]] == 1 and len(after) == 6
        assert sorted(owners.values()) == [0, 0, 1, 1, 1, 1]

        ids = batch_ids(groups=4, size=2)
        asyncio.run(run_batch(url, ids))
        for tid, s in samples(url, ids).items():
            assert s["mismatches"] == [] and sum(s["loss_mask"]) > 0, tid


def test_a_lora_update_through_the_front_reaches_every_shard(
        sim_servers: list[str], tmp_path: Path) -> None:
    """``method: "lora"`` through the front: every shard checks it first (a bad adapter is
    refused by all, loaded by none), then loads it on its own engines; each shard's calls
    run on it and are stamped with its version."""
    from backends.tinylora import write_adapter

    adapter = str(write_adapter(tmp_path / "adapter", seed=4))
    with gateway(sim_servers, 2, tmp_path) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/admin/weight-update", json={
            "version": "21", "method": "lora", "lora_path": str(tmp_path / "missing")})
        assert r.status_code == 400 and r.json()["applied"] is False, r.text
        with RolloutClient(url) as gw:
            job = gw.update_adapter("21", adapter, timeout_s=60)
        assert job.status == "succeeded" and len(job.raw["shards"]) == 2, job.raw
        status = http.get("/status").json()
        assert [s["weight_version"] for s in status["shards"]] == ["21", "21"]
        models = set()
        for i in range(8):  # trajectories spread over both shards
            tid = f"lora-front-{i}"
            answer = http.post("/v1/chat/completions", headers={"x-trajectory-id": tid},
                               json={"model": "qwen3-14b", "max_tokens": 4, "messages": [
                                   {"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
            models.add(answer.json()["model"])
        assert models == {"qwen3-14b@lora-21"}
        assert {_owner(url, 2, f"lora-front-{i}") for i in range(8)} == {0, 1}

        # a second policy, a LoRA family of the same base, with a bound of its own
        with RolloutClient(url) as gw:
            assert gw.update_adapter("3", adapter, model="verifier").status == "succeeded"
            gw.set_max_staleness(0, model="verifier")
        answers = {http.post("/v1/chat/completions", headers={"x-trajectory-id": f"v-{i}"},
                             json={"model": "verifier", "max_tokens": 4, "messages": [
                                 {"role": "user", "content": "check"}]}).json()["model"]
                   for i in range(8)}
        assert answers == {"verifier@lora-3"}
        status = http.get("/status").json()
        assert status["weight_version"] == "21"  # the base's own family: untouched
        verifier = status["models"]["verifier"]
        assert (verifier["version"], verifier["max_staleness"]) == ("3", 0)
        assert sum(verifier["trajectories"].values()) == 8  # both shards' added up
