"""Weight updates mid-rollout against real simulated vLLM servers under load.

Every mode of ``POST /admin/pause`` with calls running: no call is lost, no token is
duplicated or dropped across an abort-and-continue (every answer is exactly the tokens
the engine produced, its text exactly those tokens' text), and versions are exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from backends.sim.chat import output_piece
from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from backends.sim.tokenizer import get_tokenizer
from gateway.client import RolloutClient
from gateway.client.errors import JobFailed
from tests.gateway.conftest import GatewayFactory
from tests.servers import LoopThread, free_port

MODEL = "qwen3-14b"
N = 240
ADMIN = {"authorization": "Bearer tok"}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def slow_pool(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two simulated servers slow enough (5x) that a 240-token answer spans a pause."""
    configs = [SimServerConfig(speed=5, seed=i, tick_real_s=0.005) for i in range(2)]
    cm = start_sim_servers(configs)
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


def _text_of(ids: list[int]) -> str:
    tok = get_tokenizer()
    return "".join(output_piece(tok, i) for i in ids)


async def _call(http: httpx.AsyncClient, kind: str, stream: bool, i: int) -> dict[str, Any]:
    """One call; returns the token ids, text, finish reason and usage the client saw."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": N, "ignore_eos": True,
                            "return_token_ids": True, "stream": stream}
    if kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"question {i}"}]
        if i % 2:
            body["logprobs"] = True
    else:
        path = "/v1/completions"
        body["prompt"] = f"prompt number {i}"
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"x-trajectory-id": f"wu-{kind}-{stream}-{i}"}
    ids: list[int] = []
    text, finish, usage, lps = "", None, None, 0
    if not stream:
        r = await http.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        data = r.json()
        ch = data["choices"][0]
        ids, finish, usage = ch["token_ids"], ch["finish_reason"], data["usage"]
        text = ch["message"]["content"] if kind == "chat" else ch["text"]
        lps = len((ch.get("logprobs") or {}).get("content") or [])
        return {"ids": ids, "text": text, "finish": finish, "usage": usage, "lps": lps,
                "body": body, "i": i}
    ids_seen: set[str] = set()
    done = False
    async with http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            assert not done, "an event after [DONE]"
            chunk = orjson.loads(line[6:])
            assert "error" not in chunk, chunk
            ids_seen.add(chunk["id"])
            usage = chunk.get("usage") or usage
            for ch in chunk["choices"]:
                ids += ch.get("token_ids") or []
                part = (ch.get("delta") or {}).get("content") if kind == "chat" else ch["text"]
                text += part or ""
                lps += len((ch.get("logprobs") or {}).get("content") or [])
                if ch.get("finish_reason"):
                    assert finish is None, "two finish reasons in one stream"
                    finish = ch["finish_reason"]
    assert done and len(ids_seen) == 1, "one id for the whole stream, [DONE] last"
    return {"ids": ids, "text": text, "finish": finish, "usage": usage, "lps": lps,
            "body": body, "i": i}


def _check(result: dict[str, Any]) -> None:
    assert result["finish"] == "length"
    assert len(result["ids"]) == N  # nothing dropped, nothing duplicated
    assert result["text"] == _text_of(result["ids"])
    assert result["usage"]["completion_tokens"] == N
    if result["body"].get("logprobs") is True:
        assert result["lps"] == N


def _load(http: httpx.AsyncClient, count: int = 16) -> list[asyncio.Task[dict[str, Any]]]:
    kinds = [("chat", False), ("chat", True), ("completions", False), ("completions", True)]
    return [asyncio.create_task(_call(http, *kinds[i % 4], i)) for i in range(count)]


async def _stats(urls: list[str]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as http:
        return [(await http.get(f"{u}/sim/stats")).json() for u in urls]


async def test_abort_and_continue_loses_no_call_and_no_token(
        slow_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_pool, admin_token="tok") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60) as http:
            before = sum(s["pause_aborts"] for s in await _stats(slow_pool))
            calls = _load(http)
            await asyncio.sleep(0.4)
            r = await admin.post("/admin/pause", json={"mode": "abort-and-continue"})
            paused = r.json()
            assert r.status_code == 200 and paused["ok"], paused
            assert {e["mode"] for e in paused["engines"]} == {"abort"}
            assert paused["idle_s"] < 1.0
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls)  # clients held, not answered
            r = await admin.post("/admin/resume", json={"weight_version": "1"})
            assert r.json()["weight_version"] == "1" and r.json()["ok"]
            results = await asyncio.gather(*calls)
            stats = await _stats(slow_pool)
            info = [(await admin.get(f"{u}/weight_info")).json() for u in slow_pool]
            for res in results:
                tid = f"wu-{'chat' if 'messages' in res['body'] else 'completions'}-" \
                      f"{res['body']['stream']}-{res['i']}"
                traj = (await http.get(f"/trajectories/{tid}")).json()
                (call,) = traj["calls"]
                assert call["completion_ids"] == res["ids"]
                (_, k, first), (k2, end, second) = call["weight_segments"]
                assert (first, second, k2, end) == ("0", "1", k, N) and 0 < k < N
                sample = (await http.get(f"/trajectories/{tid}/sample")).json()
                versions = sample["weight_versions"][-N:]
                assert versions == ["0"] * k + ["1"] * (N - k)
                assert sample["max_staleness"] == 1
                stale = await http.get(f"/trajectories/{tid}/sample",
                                       params={"max_staleness": 0})
                assert stale.status_code == 409 and "stale" in stale.text, stale.text
    for res in results:
        _check(res)
    aborted = sum(s["pause_aborts"] for s in stats) - before
    assert aborted == 16  # every call was mid-generation and got continued
    continued = [s for st in stats for s in st["requests_seen"]
                 if s["max_tokens"] < N]
    assert len(continued) >= 16
    assert info == [{"weight_version": "1"}] * 2


async def test_keep_freezes_calls_and_wait_drains(
        slow_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_pool, admin_token="tok") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60) as http:
            before = sum(s["pause_aborts"] for s in await _stats(slow_pool))
            calls = _load(http, 8)
            await asyncio.sleep(0.3)
            r = (await admin.post("/admin/pause", json={"mode": "keep"})).json()
            assert {e["mode"] for e in r["engines"]} == {"keep"}
            running = sum(s["running"] for s in await _stats(slow_pool))
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls) and running == 8
            await admin.post("/admin/resume", json={"weight_version": "k1"})
            for res in await asyncio.gather(*calls):
                _check(res)

            calls = _load(http, 8)
            await asyncio.sleep(0.3)
            r = (await admin.post("/admin/pause", json={"mode": "wait",
                                                        "engine_mode": "wait"})).json()
            stats = await _stats(slow_pool)  # the engines answered once drained
            assert sum(st["running"] + st["waiting"] for st in stats) == 0
            assert r["ok"] and r["idle_s"] > 0.1
            await admin.post("/admin/resume", json={"weight_version": "w1"})
            for res in await asyncio.gather(*calls):
                _check(res)
        assert sum(s["pause_aborts"] for s in await _stats(slow_pool)) == before


async def test_a_call_that_cannot_be_continued_keeps_its_engine_frozen(
        slow_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_pool[:1], admin_token="tok") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as http:
            body = {"model": MODEL, "max_tokens": N, "ignore_eos": True,
                    "response_format": {"type": "json_object"},
                    "messages": [{"role": "user", "content": "find it"}]}
            call = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.3)
            assert not call.done(), call.result().text
            r = (await http.post("/admin/pause", json={"mode": "abort-and-continue"})).json()
            assert [e["mode"] for e in r["engines"]] == ["keep"]
            await http.post("/admin/resume", json={"weight_version": "t1"})
            answer = (await call).json()["choices"][0]
            assert answer["finish_reason"] == "length"
            assert len(answer["message"]["content"].split()) == N


async def test_bad_pause_and_resume_bodies_are_400(
        slow_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_pool, admin_token="tok") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as http:
            r = await http.post("/admin/pause", json={"mode": "later"})
            assert r.status_code == 422 and "abort-and-continue" in r.text
            r = await http.post("/admin/resume", json={"weight_version": ""})
            assert r.status_code in (400, 422)
            r = await http.post("/admin/weight-update", json={"version": "x",
                                                              "method": "reload"})
            assert r.status_code == 400 and "weights_path" in r.text


def _completion(url: str, i: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": f"job load {i}", "max_tokens": N, "ignore_eos": True,
            "return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                      headers={"x-trajectory-id": f"job-{i}"})


def test_update_weights_runs_the_cycle_as_a_job_from_the_client(
        slow_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_pool, admin_token="tok") as url, \
            RolloutClient(url, admin_token="tok", poll_interval_s=0.05) as client, \
            ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(_completion, url, i) for i in range(8)]
        time.sleep(0.3)
        pushed: list[bool] = []

        def push() -> None:  # the trainer's own transfer, while the engines are paused
            pushed.append(all(httpx.get(f"{u}/is_paused").json()["is_paused"]
                              for u in slow_pool))

        job = client.update_weights("2", push=push)
        assert pushed == [True]
        assert [p["name"] for p in job.raw["phases"]] == ["pause", "update", "resume"]
        assert job.raw["plan"]["weight_version"] == "2"
        assert job.raw["phases"][0]["idle_s"] < 1.0
        for f in calls:
            choice = f.result().json()["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == N
        assert [httpx.get(f"{u}/weight_info").json()["weight_version"]
                for u in slow_pool] == ["2", "2"]

        reloads = sum(httpx.get(f"{u}/sim/stats").json()["reloads"] for u in slow_pool)
        job = client.update_weights("3", weights_path="/models/step-3", mode="keep")
        assert job.succeeded and client.status()["weight_version"] == "3"
        after = sum(httpx.get(f"{u}/sim/stats").json()["reloads"] for u in slow_pool)
        assert after == reloads + 2


def test_an_engine_that_does_not_answer_fails_the_job_and_keeps_the_old_version(
        slow_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway_at(sqlite_url, [*slow_pool, dead], admin_token="tok") as url, \
            RolloutClient(url, admin_token="tok", poll_interval_s=0.05) as client:
        with pytest.raises(JobFailed) as failed:
            client.update_weights("9", weights_path="/models/step-9", timeout_s=5)
        assert "/pause?mode=abort failed" in str(failed.value) and "resumed with version '0'" in str(
            failed.value)
        assert client.status()["weight_version"] == "0"
        assert client.pool()["paused"] is False
        assert [httpx.get(f"{u}/is_paused").json()["is_paused"] for u in slow_pool] == [
            False, False]
        assert _completion(url, 99).status_code == 200
