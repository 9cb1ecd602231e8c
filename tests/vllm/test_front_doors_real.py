"""The Responses and Messages front doors in front of a real vLLM engine (CPU, tiny model).

The gateway translates both to chat completions upstream; what the client gets back is
its own wire format, and what the store gets is the engine's exact token ids and
logprobs, the same as for a chat call.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest

from backends.base import LaunchedInstance
from gateway.app import create_app
from gateway.config import Settings, TraceSettings
from tests.servers import free_port, serve_app, stop_app
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


def _events(raw: str) -> list[dict]:
    return [orjson.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]


async def _trace(c: httpx.AsyncClient, traj: str) -> list[dict]:
    calls = (await c.get(f"/trajectories/{traj}")).json()["calls"]
    for call in calls:
        assert call["status"] == "ok", call["error"]
        assert len(call["completion_ids"]) == call["usage"]["completion_tokens"] > 0
        assert len(call["completion_logprobs"]) == len(call["completion_ids"])
        assert call["prompt_len"] == call["usage"]["prompt_tokens"] > 0
    return calls


async def test_both_doors_capture_exact_tokens_from_real_vllm(
        tp1_server: LaunchedInstance, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'doors.db'}",
                        backends=[tp1_server.url], traces=TraceSettings(flush_interval_s=0.05))
    port = free_port()
    server, task = await serve_app(create_app(settings), port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            r1 = await c.post("/t/real-resp/v1/responses", json={
                "model": SERVED_NAME, "instructions": "Be brief.", "input": "Hello there",
                "max_output_tokens": 6})
            assert r1.status_code == 200, r1.text
            first = r1.json()
            assert first["object"] == "response" and first["output"][0]["type"] == "message"
            assert "token_ids" not in r1.text and "logprobs\":[{" not in r1.text
            async with c.stream("POST", "/t/real-resp/v1/responses", json={
                    "model": SERVED_NAME, "previous_response_id": first["id"],
                    "input": "and then?", "max_output_tokens": 6, "stream": True}) as r2:
                events = _events("".join([x async for x in r2.aiter_text()]))
            kinds = [e["type"] for e in events]
            assert kinds[0] == "response.created" and kinds[-1] in (
                "response.completed", "response.incomplete")
            calls = await _trace(c, "real-resp")
            assert len(calls) == 2 and calls[1]["prompt_len"] > calls[0]["prompt_len"]
            streamed = "".join(e["delta"] for e in events
                               if e["type"] == "response.output_text.delta")
            assert streamed == events[-1]["response"]["output"][0]["content"][0]["text"]

            m1 = await c.post("/t/real-msg/v1/messages", json={
                "model": SERVED_NAME, "max_tokens": 6, "system": "Be brief.",
                "messages": [{"role": "user", "content": "Hello there"}]})
            assert m1.status_code == 200, m1.text
            msg = m1.json()
            assert msg["type"] == "message" and msg["content"][0]["type"] == "text"
            assert msg["usage"]["output_tokens"] == 6 or msg["stop_reason"] == "end_turn"
            async with c.stream("POST", "/t/real-msg/v1/messages", json={
                    "model": SERVED_NAME, "max_tokens": 6, "stream": True,
                    "system": "Be brief.",  # resent, as harnesses do: the same branch
                    "messages": [{"role": "user", "content": "Hello there"},
                                 {"role": "assistant", "content": msg["content"]},
                                 {"role": "user", "content": "more"}]}) as m2:
                events = _events("".join([x async for x in m2.aiter_text()]))
            assert [e["type"] for e in events][:1] == ["message_start"]
            assert events[-1]["type"] == "message_stop"
            calls = await _trace(c, "real-msg")
            assert [c_["endpoint"] for c_ in calls] == ["messages", "messages"]
            sample = (await c.get("/trajectories/real-msg/sample")).json()
            assert sample["mismatches"] == []  # the second prompt extends the first as sent
            assert sum(sample["loss_mask"]) == sum(len(x["completion_ids"]) for x in calls)
    finally:
        await stop_app(server, task)
