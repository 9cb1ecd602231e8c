"""``GET /groups/{id}/samples``: one long poll per group, and ``fetch_group`` over it.

Against a live gateway over simulated vLLM servers (SQLite): the route waits until the
group has ``count`` finished trajectories (a finish that comes while it waits releases
it), answers every branch of each as ``/trajectories/{id}/samples`` does, and says 408
with the finished ids when its wait runs out; the clients turn that into ``WaitTimeout``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from gateway.client import AsyncRolloutClient, RolloutClient, WaitTimeout
from tests.client.conftest import MODEL, GatewayFactory


def _run(gw: str, group: str, size: int) -> list[str]:
    ids = [f"{group}-{k}" for k in range(size)]
    for tid in ids:
        with openai.OpenAI(base_url=f"{gw}/g/{group}/t/{tid}/v1", api_key="EMPTY",
                           max_retries=0) as llm:
            llm.chat.completions.create(model=MODEL, max_tokens=20,
                                        messages=[{"role": "user", "content": tid}])
    return ids


def test_the_route_waits_for_the_group(gateway: GatewayFactory, sqlite_url: str) -> None:
    group = f"grp-{uuid.uuid4().hex[:8]}"
    with gateway(sqlite_url) as gw, httpx.Client(base_url=gw, timeout=30) as http:
        ids = _run(gw, group, 3)
        for tid in ids[:2]:
            assert http.post(f"/trajectories/{tid}/finish", json={"reward": 1.0}).is_success
        t0 = time.monotonic()
        r = http.get(f"/groups/{group}/samples", params={"count": 3, "timeout_s": 0.3})
        assert r.status_code == 408 and time.monotonic() - t0 >= 0.3
        body = r.json()
        assert (body["finished"], body["count"]) == (2, 3)
        assert sorted(body["trajectory_ids"]) == sorted(ids[:2])
        assert "2 of 3" in body["detail"]

        # no count: what is finished now, at once
        now = http.get(f"/groups/{group}/samples").json()
        assert now["finished"] == 2 and len(now["data"]) == 2

        # a finish that comes while the route waits releases it
        timer = threading.Timer(0.5, lambda: httpx.post(
            f"{gw}/trajectories/{ids[2]}/finish", json={"reward": 0.5}, timeout=30))
        timer.start()
        t0 = time.monotonic()
        r = http.get(f"/groups/{group}/samples", params={"count": 3, "timeout_s": 20})
        waited = time.monotonic() - t0
        timer.join()
        assert r.status_code == 200, r.text
        assert 0.4 < waited < 10
        body = r.json()
        assert body["trajectory_ids"] == ids  # by creation time
        for tid, sample in zip(ids, body["data"], strict=True):
            one = http.get(f"/trajectories/{tid}/samples").json()["data"]
            assert [sample] == one  # exactly what the per-trajectory route gives
        assert [s["reward"] for s in body["data"]] == [1.0, 1.0, 0.5]

        assert http.get(f"/groups/{group}/samples",
                        params={"max_staleness": 0, "current_version": "3"}).status_code == 409
        assert http.get("/groups/bad%20id/samples").status_code == 400
        assert http.get(f"/groups/{group}/samples", params={"count": 0}).status_code == 422


def test_fetch_group_sync_and_async(gateway: GatewayFactory, sqlite_url: str) -> None:
    group = f"grp-{uuid.uuid4().hex[:8]}"
    with gateway(sqlite_url) as gw:
        ids = _run(gw, group, 3)
        with RolloutClient(gw) as client:
            client.finish(ids[0], 0.0, group_id=group)
            with pytest.raises(WaitTimeout, match="1 of 3") as partial:
                client.fetch_group(group, 3, timeout_s=0.2)
            assert partial.value.finished == [ids[0]]
            assert [s.trajectory_id for s in client.fetch_group(group)] == [ids[0]]
            for tid in ids[1:]:
                client.finish(tid, 1.0, group_id=group)
            batch = client.fetch_group(group, 3, timeout_s=10)
            assert [s.trajectory_id for s in batch] == ids
            assert batch.rewards == [0.0, 1.0, 1.0]

        async def run() -> list[Any]:
            async with AsyncRolloutClient(gw) as aclient:
                with pytest.raises(WaitTimeout, match="3 of 4"):
                    await aclient.fetch_group(group, 4, timeout_s=0.2)
                got = await aclient.fetch_group(group, 3, timeout_s=10, branches="main")
                return [s.trajectory_id for s in got]

        assert asyncio.run(run()) == ids


def test_trees_of_a_group_and_of_a_trajectory(gateway: GatewayFactory,
                                              sqlite_url: str) -> None:
    """``/groups/{id}/trees`` waits as ``/samples`` does; each tree holds its trajectory's
    branches (a side call included) as paths, every generated token once."""
    group = f"grp-{uuid.uuid4().hex[:8]}"
    with gateway(sqlite_url) as gw, RolloutClient(gw) as client:
        ids = _run(gw, group, 2)
        with openai.OpenAI(base_url=f"{gw}/g/{group}/t/{ids[0]}/v1", api_key="EMPTY",
                           max_retries=0) as llm:  # a title call: a second branch
            llm.chat.completions.create(model=MODEL, max_tokens=5,
                                        messages=[{"role": "user", "content": "title?"}])
        with pytest.raises(WaitTimeout):
            client.fetch_group_trees(group, 2, timeout_s=0.3)
        for tid in ids:
            client.finish(tid, 1.0, group_id=group)
        trees = client.fetch_group_trees(group, 2, timeout_s=20)
        assert [t.trajectory_id for t in trees] == ids
        forked = client.tree(ids[0])
        assert forked == trees[0] and len(forked.branches) == 2
        samples = client.branch_samples(ids[0])
        for b, s in zip(forked.branches, samples, strict=True):
            assert [forked.token_ids[i] for i in forked.path(b.leaf)] == s.token_ids
        generated = sum(sum(s.loss_mask) for s in samples)
        assert sum(forked.loss_mask) == generated
        assert len(forked.token_ids) < sum(len(s.token_ids) for s in samples)
