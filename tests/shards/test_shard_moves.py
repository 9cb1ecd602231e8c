"""Engines moving between the shards of ``serve --shards 2`` (issue 32, item 3): an
instance of a managed pool hands its GPUs to the other shard on request, and the
front's rebalancer moves engines on its own to the shard whose calls wait for them.
Trajectories never move: every sample of the batches run around the moves is exact."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.shards.conftest import (
    MODEL,
    agent,
    batch_ids,
    gateway,
    run_batch,
    samples,
    wait_http,
)

pytestmark = pytest.mark.postgres


def wait_job(http: httpx.Client, url: str, timeout_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (job := http.get(url).json())["status"] in ("pending", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    return dict(job)


def exact(url: str, ids: dict[str, list[str]], headers: dict[str, str] | None = None) -> None:
    for tid, s in samples(url, ids, headers).items():
        assert s["mismatches"] == [] and sum(s["loss_mask"]) > 0, tid


def test_a_managed_instance_hands_its_gpus_to_the_other_shard(tmp_path: Path) -> None:
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump({
        "model": MODEL, "inventory": {"gpus": 6}, "layout": [{"tp": 1, "count": 6}],
        "launcher": {"kind": "sim", "speed": 50}}))
    # verl keeps the layout it starts with (the default policy may re-lay out a shard's
    # GPUs as it sees fit, which would rename the instances this test moves by id)
    with gateway([], 2, tmp_path, pool=spec, env={"ROLLOUT_GATEWAY_POLICY": "verl"}) as (
            url, _), httpx.Client(base_url=url, timeout=60) as http:
        wait_http([f"{url}/ready"], 60)
        assert inventories(http) == [[0, 1, 2], [3, 4, 5]]
        ids = batch_ids(groups=4, size=2)
        asyncio.run(run_batch(url, ids))

        r = http.post("/admin/backends/s0/tp1-g2/move", json={"to": 1})
        assert r.status_code == 202, r.text
        job = wait_job(http, r.json()["url"])
        assert job["status"] == "succeeded", job
        assert [(p["name"], p["shard"]) for p in job["phases"]] == [("release", 0),
                                                                     ("adopt", 1)]
        assert job["request"]["managed"] is True and job["request"]["gpus"] == [2]
        assert inventories(http) == [[0, 1], [3, 4, 5, 2]]
        r = http.post("/admin/backends/s0/tp1-g1/move", json={"to": 1})
        assert r.status_code == 202
        assert wait_job(http, r.json()["url"])["status"] == "succeeded"
        r = http.post("/admin/backends/s0/tp1-g0/move", json={"to": 1})
        assert r.status_code == 409 and "last serving engine" in r.text  # nothing starts
        assert inventories(http) == [[0], [3, 4, 5, 2, 1]]  # nothing was lost
        # a shard restarted from its spec file starts on the GPUs it holds now
        specs = [yaml.safe_load(next(tmp_path.glob(f"state-*/pool-shard{i}.yaml")).read_text())
                 for i in (0, 1)]
        assert [s["inventory"]["nodes"][0]["gpus"] for s in specs] == [[0], [3, 4, 5, 2, 1]]
        assert sorted(g for e in specs[1]["layout"] for g in e["gpus"]) == [1, 2, 3, 4, 5]
        # the handover routes act on one shard: the front refuses them unaddressed
        r = http.post("/admin/pool/adopt", json={"gpus": [9]})
        assert r.status_code == 409 and "/admin/pool/s<n>/adopt" in r.text
        r = http.post("/admin/pool/s1/adopt", json={"gpus": [3]})
        assert r.status_code == 409 and "already this pool's" in r.text  # shard 1 answered
        assert http.post("/admin/pool/s5/adopt", json={"gpus": [9]}).status_code == 404
        # the moved GPUs serve on shard 1
        serving: dict[int, int] = {}
        deadline = time.monotonic() + 60
        while serving != {0: 0, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}:
            assert time.monotonic() < deadline, serving
            time.sleep(0.2)
            serving = {g: r["shard"] for r in http.get("/status").json()["backends"]
                       if r["routable"] for g in r["gpus"]}
        more = {f"after-{g}": [f"{t}-after" for t in ts] for g, ts in ids.items()}
        asyncio.run(run_batch(url, {**ids, **more}))  # the same ids again, and new ones
        exact(url, {**ids, **more})

        # a resize splits the GPUs by what each shard holds now, no longer evenly
        r = http.put("/admin/pool", json={"gpus": 7})
        assert r.status_code == 422 and "between 0 and 6" in r.text and "1 + 5" in r.text
        r = http.put("/admin/pool", content=b"{gpus", headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        before = [a["body"]["planned"] for a in http.get("/admin/pool").json()["shards"]]
        r = http.put("/admin/pool", json={"layout": [{"tp": 2}, {"tp": 1}]})  # TP2: no room
        assert r.status_code == 400 and r.json()["applied"] is False, r.text  # on shard 0
        after = [a["body"]["planned"] for a in http.get("/admin/pool").json()["shards"]]
        assert after == before  # shard 1, which could have, changed nothing either
        r = http.put("/admin/pool", json={"gpus": 4})
        assert r.status_code == 202, r.text
        assert wait_job(http, r.json()["url"])["status"] == "succeeded"
        pools = [a["body"] for a in http.get("/admin/pool").json()["shards"]]
        assert [len(p["active_gpus"]) for p in pools] == [1, 3]


def inventories(http: httpx.Client) -> list[list[int]]:
    """Each shard's GPUs (its pool's inventory)."""
    pools = [a["body"] for a in http.get("/admin/pool").json()["shards"]]
    return [[g for node in p["inventory"] for g in node["gpus"]] for p in pools]


ADMIN = {"authorization": "Bearer adm-secret"}


def owners(url: str, tids: list[str]) -> dict[str, int]:
    """The shard each trajectory is routed to, as HAProxy names it (``x-shard``), asked
    with a call that starts nothing (``GET /t/{id}/v1/models``)."""
    with httpx.Client(base_url=url, timeout=30, headers=ADMIN) as http:
        return {t: int(http.get(f"/t/{t}/v1/models").headers["x-shard"].removeprefix("s"))
                for t in tids}


def test_the_rebalancer_moves_engines_to_the_shard_whose_calls_wait(tmp_path: Path) -> None:
    """A batch whose trajectories all hash to shard 0: the front moves shard 1's managed
    instances there on its own (release, adopt), and every sample stays exact."""
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump({
        "model": MODEL, "inventory": {"gpus": 6}, "layout": [{"tp": 1, "count": 6}],
        "launcher": {"kind": "sim", "speed": 50}}))
    env = {"ROLLOUT_GATEWAY_ADMIN_TOKEN": ADMIN["authorization"].split()[1],
           "ROLLOUT_GATEWAY_POLICY": "verl",
           "ROLLOUT_GATEWAY_SHARDS__REBALANCE_S": "0.3",
           "ROLLOUT_GATEWAY_SHARDS__REBALANCE_COOLDOWN_S": "1",
           "ROLLOUT_GATEWAY_SHARDS__REBALANCE_MIN_CALLS": "4"}
    with gateway([], 2, tmp_path, env=env, pool=spec) as (url, _), \
            httpx.Client(base_url=url, timeout=60, headers=ADMIN) as http:
        wait_http([f"{url}/ready"], 60)
        with httpx.Client(base_url=url, timeout=30) as anonymous:
            assert anonymous.get("/admin/rebalance").status_code == 401
            assert anonymous.put("/admin/rebalance", json={"ratio": 0.5}).status_code == 401
        assert http.get("/admin/rebalance").json()["enabled"] is True
        routed = owners(url, [f"heavy-{k}" for k in range(60)])
        heavy = sorted(t for t, s in routed.items() if s == 0)[:20]
        assert len(heavy) >= 12, routed
        ids = {f"grp-{g}": heavy[g::5] for g in range(5)}  # all on shard 0

        async def skewed() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120, headers=ADMIN) as c:
                await asyncio.gather(*(agent(c, g, t, turns=10, tokens=1500)
                                       for g, ts in ids.items() for t in ts))

        asyncio.run(skewed())
        state = http.get("/admin/rebalance").json()
        moves = [d for d in state["decisions"] if d["outcome"] == "started"]
        assert moves, state
        assert all(d["backend"].startswith("s1/") and d["to"] == 0 for d in moves), moves
        for d in moves:
            job = wait_job(http, f"/admin/jobs/{d['job']}")
            assert job["status"] == "succeeded", job
            assert [p["name"] for p in job["phases"]] == ["release", "adopt"]
        with httpx.Client(base_url=url, timeout=30) as anonymous:  # its jobs are the admin's
            assert anonymous.get(f"/admin/jobs/{moves[0]['job']}").status_code == 401
        held = inventories(http)
        assert len(held[0]) == 3 + len(moves) and len(held[1]) == 3 - len(moves) >= 1, held
        assert sorted(held[0] + held[1]) == list(range(6))  # every GPU in exactly one shard
        exact(url, ids, ADMIN)
        events = [e for e in http.get("/status").json()["events"] if e["kind"] == "rebalance"]
        assert events and "to shard 0, started" in events[0]["message"], events
        print(f"rebalancer: {len(moves)} move(s) to the busy shard ({moves[0]['reason']}); "
              f"GPUs per shard now {[len(h) for h in held]}")

        r = http.put("/admin/rebalance", json={"enabled": False, "ratio": 3})
        assert r.status_code == 200 and r.json()["enabled"] is False and r.json()["ratio"] == 3
        assert http.put("/admin/rebalance", json={"ratio": 0.5}).status_code == 422
        assert http.get("/status").json()["rebalance"]["enabled"] is False
