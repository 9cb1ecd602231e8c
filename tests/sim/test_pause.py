"""The simulated server's pause/resume/version routes, as vLLM 0.32 answers them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig

MODEL = "qwen3-14b"


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with start_sim_servers([SimServerConfig(speed=5, tick_real_s=0.005)]) as found:
        yield found[0]


def _body(n: int, stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": n, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}


async def test_abort_finishes_in_flight_with_partial_tokens_and_holds_new_work(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        call = asyncio.create_task(http.post("/v1/completions", json=_body(2000)))
        await asyncio.sleep(0.3)
        t0 = asyncio.get_running_loop().time()
        r = await http.post("/pause", params={"mode": "abort"})
        assert r.json() == {"status": "paused"}
        assert asyncio.get_running_loop().time() - t0 < 0.5
        out = (await call).json()["choices"][0]
        assert out["finish_reason"] == "abort"
        assert 0 < len(out["token_ids"]) < 2000
        assert out["text"] == "".join(f" {w}" for w in out["text"].split())  # whole words
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        later = asyncio.create_task(http.post("/v1/completions", json=_body(5)))
        await asyncio.sleep(0.2)
        assert not later.done()  # queued while paused
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert len((await later).json()["choices"][0]["token_ids"]) == 5
        assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_abort_ends_a_stream_with_an_abort_chunk(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async def read() -> tuple[list[int], list[str | None]]:
            ids: list[int] = []
            finishes: list[str | None] = []
            async with http.stream("POST", "/v1/completions", json=_body(2000, True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):

                        for ch in orjson.loads(line[6:])["choices"]:
                            ids += ch.get("token_ids") or []
                            finishes.append(ch.get("finish_reason"))
            return ids, finishes

        task = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        await http.post("/pause", params={"mode": "abort"})
        ids, finishes = await task
        assert finishes[-1] == "abort" and 0 < len(ids) < 2000
        await http.post("/resume")


async def test_keep_freezes_and_resume_finishes_every_token(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        call = asyncio.create_task(http.post("/v1/completions", json=_body(300)))
        await asyncio.sleep(0.2)
        await http.post("/pause", params={"mode": "keep"})
        stats = (await http.get("/sim/stats")).json()
        await asyncio.sleep(0.3)
        assert not call.done() and stats["running"] == 1
        await http.post("/resume")
        out = (await call).json()["choices"][0]
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 300


async def _running(http: httpx.AsyncClient) -> float:
    metrics = (await http.get("/metrics")).text
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("vllm:num_requests_running"))
    return float(line.rsplit(" ", 1)[1])


async def test_wait_returns_after_in_flight_calls_finish(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        call = asyncio.create_task(http.post("/v1/completions", json=_body(300)))
        for _ in range(200):  # until the engine runs it (a loaded machine is slow to send)
            if await _running(http):
                break
            await asyncio.sleep(0.01)
        assert not call.done()
        await http.post("/pause", params={"mode": "wait"})
        assert await _running(http) == 0  # the engine finished it before answering
        # its answer was sent before the pause returned: it arrives at once, whole
        done = await asyncio.wait_for(call, timeout=2)
        assert done.json()["choices"][0]["finish_reason"] == "length"
        await http.post("/resume")


async def test_version_routes_and_bad_input(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.get("/weight_info")).json() == {"weight_version": "default"}
        r = await http.post("/update_weight_version", json={"new_version": "v7"})
        assert r.json() == {"success": True, "new_version": "v7"}
        assert (await http.get("/weight_info")).json() == {"weight_version": "v7"}
        bad = await http.post("/pause", params={"mode": "later"})
        assert bad.status_code == 400 and "mode" in bad.json()["error"]["message"]
        assert (await http.post("/update_weight_version", json={})).status_code == 400
        rpc = await http.post("/collective_rpc", json={"method": "reload_weights"})
        assert rpc.status_code == 200


async def test_abort_requests_by_id_while_frozen_and_weight_spans(url: str,
                                                                 tmp_path: object) -> None:
    """A keep pause, one request aborted by its vLLM id (the other stays frozen), a new
    weight label, resume: each request's ``weight_spans`` say which label made which
    delivered token, as vLLM's output processor tracks them."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        frozen = asyncio.create_task(http.post("/v1/completions", json={
            **_body(300), "request_id": "keep-me"}))
        gone = asyncio.create_task(http.post("/v1/completions", json={
            **_body(300), "request_id": "abort-me"}))
        await asyncio.sleep(0.3)
        await http.post("/pause", params={"mode": "keep"})
        r = await http.post("/abort_requests", json={"request_ids": ["cmpl-abort-me"]})
        assert r.json() == {"status": "aborted", "aborted": 1}
        aborted = (await gone).json()
        assert aborted["id"] == "cmpl-abort-me"
        k = len(aborted["choices"][0]["token_ids"])
        assert aborted["choices"][0]["finish_reason"] == "abort" and 0 < k < 300
        await http.post("/update_weight_version", json={"new_version": "v2"})
        ckpt = tmp_path / "step-2"  # type: ignore[operator]
        bad = await http.post("/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}})
        assert bad.status_code == 500  # no such checkpoint: vLLM fails the same way
        ckpt.mkdir()
        ok = await http.post("/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}})
        assert ok.status_code == 200
        assert (await http.post("/reset_prefix_cache")).json() == {"success": True}
        await http.post("/resume")
        assert len((await frozen).json()["choices"][0]["token_ids"]) == 300
        stats = (await http.get("/sim/stats")).json()
    spans = {s["id"]: s["weight_spans"] for s in stats["requests_seen"]}
    assert spans["cmpl-abort-me"] == [[0, k, "default"]]
    (_, j, first), (j2, end, second) = spans["cmpl-keep-me"]
    assert (first, second, j2, end) == ("default", "v2", j, 300) and 0 < j < 300
    assert stats["weights_path"] == str(ckpt)
