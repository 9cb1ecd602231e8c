"""The trainer-side client against a live gateway over simulated vLLM servers.

The round trip a trainer does (launch a group, finish with rewards, fetch the batch as
Parquet, read it back with pyarrow) runs on Postgres with both clients; errors, waits,
weight sync and the pool run on SQLite.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow.parquet as pq
import pytest

from gateway.client import (
    AsyncRolloutClient,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GatewayConnectionError,
    NotFoundError,
    RolloutClient,
    SampleBatch,
    WaitTimeout,
    new_id,
    session_headers,
)
from gateway.store.export import SAMPLE_SCHEMA
from tests.client.conftest import ADMIN_TOKEN, MODEL, GatewayFactory, check_trace
from tests.servers import free_port

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                   "required": ["cmd"]}}}]


def _turns(llm: openai.OpenAI, turns: int, seed: int) -> None:
    """A small agent: ``turns`` calls, echoing each answer and a tool result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the failing test"}]
    for t in range(turns):
        msg = llm.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                          max_tokens=60, seed=seed + t).choices[0].message
        echoed: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            echoed["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for c in msg.tool_calls]
        messages.append(echoed)
        messages += ([{"role": "tool", "tool_call_id": c.id, "content": f"ok {t}"}
                      for c in msg.tool_calls] if msg.tool_calls
                     else [{"role": "user", "content": "go on"}])


def _launch(client: RolloutClient | AsyncRolloutClient, group: str, size: int) -> list[str]:
    ids = [f"{group}-{k}" for k in range(size)]
    for k, tid in enumerate(ids):
        with openai.OpenAI(base_url=client.base_url_for(tid, group), api_key="EMPTY",
                           max_retries=0) as llm:
            _turns(llm, turns=2 + k % 2, seed=10 * k)
    return ids


def _check_batch(gw: str, path: Path, ids: list[str], rewards: dict[str, float],
                 group: str) -> None:
    table = pq.read_table(path)
    assert table.schema == SAMPLE_SCHEMA
    rows = {r["trajectory_id"]: r for r in table.to_pylist()}
    assert sorted(rows) == sorted(ids)
    for tid in ids:
        calls = check_trace(gw, tid, min_calls=2)["calls"]
        row = rows[tid]
        assert row["group_id"] == group and row["reward"] == rewards[tid]
        assert row["token_ids"] == [t for c in calls
                                    for t in c["prompt_delta_ids"] + c["completion_ids"]]
        assert len(row["loss_mask"]) == len(row["logprobs"]) == len(row["token_ids"])
        completion = [lp for c in calls for lp in c["completion_logprobs"]]
        masked = [lp for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m]
        assert masked == pytest.approx(completion, abs=1e-6)  # float32 in Parquet
        assert row["weight_versions"][-1] == "0" and row["num_calls"] == len(calls)
        assert row["num_mismatches"] == 0 and json.loads(row["metadata"]) == {"k": tid}


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_round_trip_on_postgres(gateway: GatewayFactory, postgres_url: str, tmp_path: Path,
                                kind: str) -> None:
    group = f"grp-{uuid.uuid4().hex[:8]}"
    with gateway(postgres_url) as gw:
        rewards: dict[str, float] = {}
        if kind == "sync":
            with RolloutClient(gw, poll_interval_s=0.05) as client:
                ids = _launch(client, group, 4)
                rewards = {tid: k / 4 for k, tid in enumerate(ids)}
                for tid in ids[:3]:
                    client.finish(tid, rewards[tid], metadata={"k": tid})
                with pytest.raises(WaitTimeout) as partial:
                    client.wait_for_group(group, 4, timeout_s=0.2)
                client.finish(ids[3], rewards[ids[3]], metadata={"k": ids[3]})
                batch = client.fetch_group(group, 4, timeout_s=10)
        else:
            async def run() -> tuple[list[str], SampleBatch]:
                async with AsyncRolloutClient(gw, poll_interval_s=0.05) as client:
                    ids = await asyncio.to_thread(_launch, client, group, 4)
                    rewards.update({tid: k / 4 for k, tid in enumerate(ids)})
                    for tid in ids[:3]:
                        await client.finish(tid, rewards[tid], metadata={"k": tid})
                    with pytest.raises(WaitTimeout) as partial:
                        await client.wait_for_group(group, 4, timeout_s=0.2)
                    assert len(partial.value.finished) == 3
                    await client.finish(ids[3], rewards[ids[3]], metadata={"k": ids[3]})
                    return ids, await client.fetch_group(group, 4, timeout_s=10)

            ids, batch = asyncio.run(run())
        if kind == "sync":
            assert sorted(i.id for i in partial.value.finished) == sorted(ids[:3])
        assert len(batch) == 4 and batch.num_mismatches == 0
        assert batch.rewards == [rewards[s.trajectory_id] for s in batch]
        path = batch.to_parquet(tmp_path / "batch.parquet")
        _check_batch(gw, path, ids, rewards, group)


def test_waits_listing_and_samples(gateway: GatewayFactory, sqlite_url: str) -> None:
    group = f"grp-{uuid.uuid4().hex[:8]}"
    with gateway(sqlite_url) as gw, RolloutClient(gw, poll_interval_s=0.05) as client:
        ids = _launch(client, group, 2)
        listed = client.list_trajectories(group_id=group)
        assert [t.id for t in listed] == ids and not any(t.finished for t in listed)
        assert all(t.calls >= 2 and t.completion_tokens > 0 for t in listed)
        assert client.list_trajectories(group_id=group, finished=True) == []
        with pytest.raises(WaitTimeout, match="0 of 3 trajectories"):
            client.wait_for_trajectories([*ids, "never-ran"], timeout_s=0.1)
        done = client.finish_many({ids[0]: 1.0, ids[1]: None}, group_id=group)
        assert [(d.id, d.reward, d.finished) for d in done] == [(ids[0], 1.0, True),
                                                                 (ids[1], None, True)]
        assert [t.id for t in client.wait_for_trajectories(ids, timeout_s=5)] == ids
        sample = client.sample(ids[0])
        assert sample.trajectory_id == ids[0] and sample.reward == 1.0
        assert sample.num_prompt_tokens == sample.calls[0].completion_start > 0
        assert [s.seq for s in sample.calls] == list(range(len(sample.calls)))
        table = client.samples(ids).to_table()
        assert table.column("trajectory_id").to_pylist() == ids
        detail = client.trajectory(ids[1])
        assert detail["group_id"] == group and len(detail["calls"]) >= 2
        # a policy's own reward: its samples carry it, the others the trajectory's
        model = client.trajectory(ids[0])["calls"][0]["model"]
        client.finish(ids[0], 1.0, rewards={model: 0.5})
        assert client.sample(ids[0], model=model).reward == 0.5
        assert client.sample(ids[0]).reward == 1.0


def test_gateway_errors_become_typed_exceptions(gateway: GatewayFactory,
                                               sqlite_url: str) -> None:
    with gateway(sqlite_url, admin_token=ADMIN_TOKEN, trainer_token="trainer-secret") as gw:
        with RolloutClient(gw) as anonymous:
            with pytest.raises(AuthenticationError, match="trainer token") as denied:
                anonymous.sample("nope")
            assert denied.value.status_code == 401
            with pytest.raises(AuthenticationError, match="admin"):
                anonymous.pause()
            with pytest.raises(ValueError, match="invalid trajectory_id"):
                anonymous.base_url_for("has space")
        with RolloutClient(gw, trainer_token="trainer-secret") as trainer:
            with pytest.raises(NotFoundError, match="no trajectory 'nope'") as nf:
                trainer.sample("nope")
            assert nf.value.status_code == 404
            with pytest.raises(AuthenticationError, match="admin token") as role:
                trainer.pause()  # the trainer's token is not the operator's
            assert role.value.status_code == 403
        with RolloutClient(gw, admin_token="wrong") as wrong, pytest.raises(AuthenticationError):
            wrong.set_weight_version("v1")
        with RolloutClient(gw, admin_token=ADMIN_TOKEN) as admin:
            with pytest.raises(ConflictError, match="no managed pool") as conflict:
                admin.resize_pool(2)
            assert conflict.value.status_code == 409
            with pytest.raises(BadRequestError, match="version"):
                admin.set_weight_version("")
            assert admin.pool()["managed"] is False
            policy = admin.policy()
            other = next(p for p in policy["available"] if p != policy["policy"])
            assert admin.set_policy(other)["previous"] == policy["policy"]
            assert admin.policy()["policy"] == other
            with pytest.raises(BadRequestError, match="unknown policy 'nope'"):
                admin.set_policy("nope")
            assert [(b["id"], b["healthy"]) for b in admin.backends()] == [("b0", True),
                                                                            ("b1", True)]
    with RolloutClient(f"http://127.0.0.1:{free_port()}", timeout_s=2) as down, \
            pytest.raises(GatewayConnectionError, match="ConnectError"):
        down.status()


def test_weight_sync_pauses_bumps_and_resumes(gateway: GatewayFactory,
                                              sqlite_url: str) -> None:
    tid = new_id("sync")
    with gateway(sqlite_url, admin_token=ADMIN_TOKEN) as gw, \
            RolloutClient(gw, admin_token=ADMIN_TOKEN) as client:
        key = client.mint_key(tid, "g-sync")  # the harness's only credential
        llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0,
                            default_headers=session_headers(tid, "g-sync"))
        hi = [{"role": "user", "content": "hi"}]
        llm.chat.completions.create(model=MODEL, messages=hi, max_tokens=5)
        with client.weight_sync("v1") as paused:
            assert paused["paused"] is True and paused["idle"] is True
            assert client.pool()["paused"] is True
        assert client.pool()["paused"] is False
        llm.chat.completions.create(model=MODEL, messages=hi, max_tokens=5)
        with pytest.raises(RuntimeError, match="load failed"), client.weight_sync("v2"):
            raise RuntimeError("load failed")
        assert client.pool()["paused"] is False  # resumed, and the version was not bumped
        assert client.set_weight_version("v3") == "v1"
        llm.chat.completions.create(model=MODEL, messages=hi, max_tokens=5)
        detail = client.trajectory(tid)
        llm.close()
    assert detail["group_id"] == "g-sync"  # the key and the headers (which agree) tagged it
    assert [c["weight_version"] for c in detail["calls"]] == ["0", "v1", "v3"]


def _sim_pool_spec(gpus: int) -> dict[str, Any]:
    return {"model": MODEL, "inventory": {"gpus": gpus},
            "launcher": {"kind": "sim", "speed": 50, "options": {"output_len_median": 10}},
            "layout": [{"tp": 1, "count": gpus}], "check_interval_s": 0.05}


def test_resize_pool_waits_for_the_job(gateway: GatewayFactory, sqlite_url: str,
                                       tmp_path: Path) -> None:
    spec = tmp_path / "pool.json"
    spec.write_text(json.dumps(_sim_pool_spec(2)))
    with gateway(sqlite_url, pool=spec, admin_token=ADMIN_TOKEN, backends=[]) as gw:

        async def run() -> None:
            async with AsyncRolloutClient(gw, admin_token=ADMIN_TOKEN,
                                          poll_interval_s=0.05) as client:
                assert (await client.wait_job("1", timeout_s=30)).succeeded  # initial layout
                job = await client.resize_pool(layout=[{"tp": 2}], timeout_s=60)
                assert job.succeeded and job.kind and job.raw["phases"]
                pool = await client.pool()
                assert [(i["tp"], i["state"]) for i in pool["instances"]] == [(2, "ready")]
                with pytest.raises(BadRequestError):
                    await client.resize_pool(layout=[{"tp": 4}])  # only 2 GPUs
                job = await client.resize_pool(1, wait=False)
                assert (await client.wait_job(job.id, timeout_s=60)).succeeded
                assert len((await client.pool())["instances"]) == 1

        asyncio.run(run())


class _Reaped(httpx.BaseTransport):
    """A transport whose next ``fail`` requests find their connection closed by the server
    (an idle keep-alive connection reaped as the request went out); the rest go through."""

    def __init__(self, fail: int) -> None:
        self.inner, self.fail, self.sent = httpx.HTTPTransport(), fail, []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.method)
        if self.fail:
            self.fail -= 1
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                            request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_a_get_on_a_reaped_connection_is_sent_again(gateway: GatewayFactory,
                                                    sqlite_url: str) -> None:
    with gateway(sqlite_url, admin_token=ADMIN_TOKEN) as gw:
        once = _Reaped(fail=1)
        with httpx.Client(base_url=gw, transport=once) as http, \
                RolloutClient(gw, admin_token=ADMIN_TOKEN, http=http) as client:
            assert client.status()["weight_version"]
            assert once.sent == ["GET", "GET"]
        twice = _Reaped(fail=2)
        with httpx.Client(base_url=gw, transport=twice) as http, \
                RolloutClient(gw, admin_token=ADMIN_TOKEN, http=http) as client, \
                pytest.raises(GatewayConnectionError, match="RemoteProtocolError"):
            client.status()  # once only
        post = _Reaped(fail=1)
        with httpx.Client(base_url=gw, transport=post) as http, \
                RolloutClient(gw, admin_token=ADMIN_TOKEN, http=http) as client:
            with pytest.raises(GatewayConnectionError):
                client.set_weight_version("v9")  # not idempotent: not sent again
            assert len(post.sent) == 1 and post.sent[0] in ("PUT", "POST")
            assert client.status()["weight_version"] != "v9"
