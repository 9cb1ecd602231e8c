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
from pathlib import Path
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
from tests.gateway.slow_engines import (
    ADMIN,
    HARNESS,
    KEY,
    MODEL,
    N,
    engine_stats,
    generating,
)
from tests.servers import LoopThread, free_port


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


async def test_abort_and_continue_loses_no_call_and_no_token(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            before = sum(s["pause_aborts"] for s in await engine_stats(slow_engines))
            calls = _load(http)
            await generating(slow_engines, 12)
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
            stats = await engine_stats(slow_engines)
            info = [(await admin.get(f"{u}/weight_info")).json() for u in slow_engines]
            spanned = 0
            for res in results:
                tid = f"wu-{'chat' if 'messages' in res['body'] else 'completions'}-" \
                      f"{res['body']['stream']}-{res['i']}"
                traj = (await admin.get(f"/trajectories/{tid}")).json()
                (call,) = traj["calls"]
                segments = call["weight_segments"]
                if segments is None:
                    # held at the gateway's gate (v1), or reached the engine just after it
                    # paused and waited there (recorded as v0: the conservative side)
                    assert call["weight_version"] in ("0", "1")
                    continue
                spanned += 1
                if len(segments) == 1:  # aborted before its first token: all new weights
                    assert segments == [[0, N, "1"]]
                    k = 0
                else:
                    (_, k, first), (k2, end, second) = segments
                    assert (first, second, k2, end) == ("0", "1", k, N) and 0 < k < N
                sample = (await admin.get(f"/trajectories/{tid}/sample")).json()
                versions = sample["weight_versions"][-N:]
                assert versions == ["0"] * k + ["1"] * (N - k)
                assert sample["max_staleness"] == (1 if k else 0)
                if not k:
                    continue
                stale = await admin.get(f"/trajectories/{tid}/sample",
                                       params={"max_staleness": 0})
                assert stale.status_code == 409 and "stale" in stale.text, stale.text
    for res in results:
        _check(res)
    aborted = sum(s["pause_aborts"] for s in stats) - before
    assert aborted == spanned >= 8  # every call the engines aborted was continued
    continued = [s for st in stats for s in st["requests_seen"]
                 if s["max_tokens"] < N]
    assert len(continued) >= spanned
    assert info == [{"weight_version": "1"}] * 2


async def test_keep_freezes_calls_and_wait_drains(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            before = sum(s["pause_aborts"] for s in await engine_stats(slow_engines))
            calls = _load(http, 8)
            await generating(slow_engines, 6)
            r = (await admin.post("/admin/pause", json={"mode": "keep"})).json()
            assert {e["mode"] for e in r["engines"]} == {"keep"}
            # the streams stay frozen in the engines; the whole calls (their clients have
            # seen nothing) were aborted there, to be finished after resume
            frozen = sum(s["running"] + s["waiting"] for s in await engine_stats(slow_engines))
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls) and frozen >= 3
            assert sum(e["aborted"] for e in r["engines"]) >= 3
            await admin.post("/admin/resume", json={"weight_version": "k1"})
            for res in await asyncio.gather(*calls):
                _check(res)

            calls = _load(http, 8)
            await asyncio.sleep(0.3)
            r = (await admin.post("/admin/pause", json={"mode": "wait",
                                                        "engine_mode": "wait"})).json()
            stats = await engine_stats(slow_engines)  # the engines answered once drained
            assert sum(st["running"] + st["waiting"] for st in stats) == 0
            assert r["ok"] and r["idle_s"] > 0.1
            await admin.post("/admin/resume", json={"weight_version": "w1"})
            for res in await asyncio.gather(*calls):
                _check(res)
        assert sum(s["pause_aborts"] for s in await engine_stats(slow_engines)) == before


async def test_bad_pause_and_resume_bodies_are_400(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
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
                      headers={"x-trajectory-id": f"job-{i}", **HARNESS})


def checkpoint(root: Path, name: str) -> str:
    """A directory with what a checkpoint needs (the simulated server loads nothing)."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def test_update_weights_runs_the_cycle_as_a_job_from_the_client(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url, \
            RolloutClient(url, admin_token="tok", poll_interval_s=0.05) as client, \
            ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(_completion, url, i) for i in range(8)]
        time.sleep(0.3)
        pushed: list[bool] = []

        def push() -> None:  # the trainer's own transfer, while the engines are paused
            pushed.append(all(httpx.get(f"{u}/is_paused").json()["is_paused"]
                              for u in slow_engines))

        job = client.update_weights("2", push=push)
        assert pushed == [True]
        assert [p["name"] for p in job.raw["phases"]] == ["check", "pause", "update",
                                                          "resume"]
        assert job.raw["plan"]["weight_version"] == "2"
        assert job.raw["phases"][1]["idle_s"] < 1.0
        for f in calls:
            choice = f.result().json()["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == N
        assert [httpx.get(f"{u}/weight_info").json()["weight_version"]
                for u in slow_engines] == ["2", "2"]

        reloads = sum(httpx.get(f"{u}/sim/stats").json()["reloads"] for u in slow_engines)
        job = client.update_weights("3", weights_path=checkpoint(tmp_path, "step-3"),
                                    mode="keep")
        assert job.succeeded and client.status()["weight_version"] == "3"
        after = sum(httpx.get(f"{u}/sim/stats").json()["reloads"] for u in slow_engines)
        assert after == reloads + 2


def test_an_engine_that_does_not_answer_fails_the_job_and_keeps_the_old_version(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway_at(sqlite_url, [*slow_engines, dead], admin_token="tok", api_keys=[KEY]) as url, \
            RolloutClient(url, admin_token="tok", poll_interval_s=0.05) as client:
        with pytest.raises(JobFailed) as failed:
            client.update_weights("9", weights_path=checkpoint(tmp_path, "step-9"),
                                  timeout_s=5)
        assert "/pause?mode=abort failed" in str(failed.value) and "resumed with version '0'" in str(
            failed.value)
        assert client.status()["weight_version"] == "0"
        assert client.pool()["paused"] is False
        assert [httpx.get(f"{u}/is_paused").json()["is_paused"] for u in slow_engines] == [
            False, False]
        assert _completion(url, 99).status_code == 200


@pytest.fixture(scope="module")
def long_pool(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Slow servers whose answers always run to ``max_tokens``: the front doors pass no
    ``ignore_eos``, and an answer must be exactly N tokens to check a continuation."""
    configs = [SimServerConfig(speed=5, seed=i, tick_real_s=0.005,
                               output_len_median=50 * N, output_len_sigma=0.01)
               for i in range(2)]
    cm = start_sim_servers(configs)
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


def _sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) pairs of a door's stream."""
    out = []
    for block in raw.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            out.append((lines.get("event", ""), orjson.loads(lines["data"])))
    return out


async def _door_call(http: httpx.AsyncClient, door: str, stream: bool, i: int
                     ) -> dict[str, Any]:
    """One call through a front door; the answer's text and token count as the client
    saw them, checked to be one uninterrupted answer in the door's format."""
    tid = f"door-{door}-{stream}-{i}"
    if door == "responses":
        path = "/v1/responses"
        body: dict[str, Any] = {"model": MODEL, "input": f"question {i}",
                                "max_output_tokens": N, "stream": stream}
    else:
        path = "/v1/messages"
        body = {"model": MODEL, "max_tokens": N, "stream": stream,
                "messages": [{"role": "user", "content": f"question {i}"}]}
    r = await http.post(path, json=body, headers={"x-trajectory-id": tid})
    assert r.status_code == 200, r.text
    if not stream:
        data = r.json()
        if door == "responses":
            assert data["status"] == "incomplete", data
            assert data["incomplete_details"] == {"reason": "max_output_tokens"}
            (item,) = data["output"]
            (part,) = item["content"]
            return {"tid": tid, "text": part["text"], "tokens": data["usage"]["output_tokens"]}
        assert data["stop_reason"] == "max_tokens", data
        (block,) = data["content"]
        return {"tid": tid, "text": block["text"], "tokens": data["usage"]["output_tokens"]}
    events = _sse(r.text)
    kinds = [k for k, _ in events]
    assert "error" not in kinds, events
    if door == "responses":
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
        assert kinds.count("response.incomplete") == 1 and "response.completed" not in kinds
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert kinds.count("response.output_item.added") == 1  # one message
        text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
        final = events[-1][1]["response"]
        assert final["output"][0]["content"][0]["text"] == text
        return {"tid": tid, "text": text, "tokens": final["usage"]["output_tokens"]}
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("message_stop") == 1 and kinds.count("message_delta") == 1
    assert kinds.count("content_block_start") == 1  # one text block, never reopened
    (delta,) = [d for k, d in events if k == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    return {"tid": tid, "text": text, "tokens": delta["usage"]["output_tokens"]}


async def test_abort_and_continue_through_the_front_doors(
        long_pool: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    """/v1/responses and /v1/messages, whole and streamed: a call the engines abort is
    continued, and the client gets one answer of exactly N tokens in its own format."""
    with gateway_at(sqlite_url, long_pool, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            before = sum(s["pause_aborts"] for s in await engine_stats(long_pool))
            kinds = [(d, s) for d in ("responses", "messages") for s in (False, True)]
            calls = [asyncio.create_task(_door_call(http, *kinds[i % 4], i))
                     for i in range(12)]
            await generating(long_pool, 10)
            r = await admin.post("/admin/pause", json={"mode": "abort-and-continue"})
            assert r.status_code == 200 and r.json()["ok"], r.text
            assert {e["mode"] for e in r.json()["engines"]} == {"abort"}
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in calls)  # clients held, not answered
            r = await admin.post("/admin/resume", json={"weight_version": "1"})
            assert r.json()["ok"], r.text
            results = await asyncio.gather(*calls)
            aborted = sum(s["pause_aborts"] for s in await engine_stats(long_pool)) - before
            spanned, split = 0, set()
            for res in results:
                (call,) = (await admin.get(f"/trajectories/{res['tid']}")).json()["calls"]
                ids = call["completion_ids"]
                assert len(ids) == N and res["tokens"] == N  # nothing dropped or doubled
                assert res["text"] == _text_of(ids)
                assert call["finish_reason"] == "length"
                segments = call["weight_segments"]
                if segments is None:
                    assert call["weight_version"] in ("0", "1")
                    continue
                spanned += 1
                if len(segments) == 1:  # aborted before its first token
                    assert segments == [[0, N, "1"]]
                    k = 0
                else:
                    (_, k, first), (k2, end, second) = segments
                    assert (first, second, k2, end) == ("0", "1", k, N) and 0 < k < N
                    split.add(res["tid"].rsplit("-", 1)[0])
                sample = (await admin.get(f"/trajectories/{res['tid']}/sample")).json()
                assert sample["weight_versions"][-N:] == ["0"] * k + ["1"] * (N - k)
    assert aborted == spanned >= 8  # every call the engines aborted was continued
    assert len(split) == 4, split  # each door, whole and streamed, continued mid-answer


async def test_an_abort_the_gateway_did_not_ask_for_reaches_the_client(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    """Only calls whose engine the gateway paused in abort-and-continue are continued:
    an engine that aborts on its own (here: paused behind the gateway's back, as on a
    shutdown) ends the call with ``abort``, even after an abort-and-continue pause."""
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            await admin.post("/admin/pause", json={"mode": "abort-and-continue"})
            await admin.post("/admin/resume", json={"weight_version": "1"})
            calls = _load(http, 4)
            await generating(slow_engines, 4)
            try:
                for u in slow_engines:
                    assert (await http.post(f"{u}/pause?mode=abort")).status_code == 200
                results = await asyncio.wait_for(asyncio.gather(*calls), 10)
            finally:
                for u in slow_engines:
                    await http.post(f"{u}/resume")
    for res in results:
        assert res["finish"] == "abort" and len(res["ids"]) < N
