"""Turns kept as generated on a real vLLM engine (CPU, tiny random model, hermes tools).

A tool-using agent loop as a harness writes it: the assistant message echoed back as the
OpenAI client parsed it, then the tool's result or the next user turn. The engine's chat
template re-renders the echoed turn (a forced tool call is generated as bare JSON but
rendered inside ``<tool_call>`` tags; the random model's text does not survive
decode-then-encode), so without token in every such turn left the record: 38% of the
generated tokens kept loss mask 1 in the run that found it. With it, each call runs on
the record, every call stays on one branch, and the sample keeps every generated token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from backends.base import LaunchedInstance
from gateway.app import create_app
from gateway.config import Settings, TraceSettings
from tests.servers import free_port, serve_app, stop_app
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


async def _turn(c: httpx.AsyncClient, traj: str, messages: list[dict[str, Any]], *,
                forced: bool, stream: bool) -> dict[str, Any]:
    """One call; the assistant message as the OpenAI client would hand it back."""
    body = {"model": SERVED_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 24,
            "tool_choice": FORCED if forced else "auto", "stream": stream}
    if not stream:
        r = await c.post(f"/t/{traj}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        return {"role": "assistant", "content": msg.get("content"),
                **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})}
    text, calls = [], {}
    async with c.stream("POST", f"/t/{traj}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            for ch in orjson.loads(line[5:]).get("choices") or ():
                delta = ch.get("delta") or {}
                text.append(delta.get("content") or "")
                for tc in delta.get("tool_calls") or ():
                    cur = calls.setdefault(tc.get("index", 0), {
                        "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    cur["id"] = tc.get("id") or cur["id"]
                    fn = tc.get("function") or {}
                    cur["function"]["name"] += fn.get("name") or ""
                    cur["function"]["arguments"] += fn.get("arguments") or ""
    msg = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


async def _agent(c: httpx.AsyncClient, traj: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": "Weather in Paris and Rome?"}]
    for i, (forced, stream) in enumerate([(True, False), (False, False), (True, True),
                                          (False, True), (True, False)]):
        turn = await _turn(c, traj, messages, forced=forced, stream=stream)
        messages.append(turn)
        for call in turn.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"sunny, {20 + i} C"})
        if not turn.get("tool_calls"):
            messages.append({"role": "user", "content": "And tomorrow?"})


async def _viewer_reads_it_as_the_tokenizer_does(c: httpx.AsyncClient, trajs: list[str],
                                                 model_dir: Path) -> None:
    """The viewer's pieces come from this vLLM's /detokenize: each id's is the model's own
    tokenizer's decoding of it, and its token-in spans are the replies the engine ran from
    the record (the previous call's generated ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    spans = 0
    for traj in trajs:
        view = (await c.get(f"/trajectories/{traj}/view")).json()
        tk = view["tokens"]
        assert tk["pieces_note"] is None
        pieces = {int(k): v for k, v in tk["pieces"].items()}
        assert set(pieces) == set(tk["token_ids"])
        assert all(pieces[i] == tok.decode([i]) for i in pieces)
        calls = {x["seq"]: x for x in view["calls"]}
        by_seq = {x[0]: x for x in tk["calls"]}
        for start, end, seq in tk["token_in"]:
            assert calls[seq]["kept_len"] is not None and calls[seq]["kept_len"] >= end
            prev = max(s for s in by_seq if s < seq)
            assert start == by_seq[prev][2]  # the previous call's reply, as generated
            assert all(tk["loss_mask"][start:end])
        spans += len(tk["token_in"])
    assert spans >= len(trajs)


async def test_tool_agent_keeps_every_generated_token_on_real_vllm(
        tp1_server: LaunchedInstance, tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'tin.db'}",
                        backends=[tp1_server.url], traces=TraceSettings(flush_interval_s=0.05))
    port = free_port()
    server, task = await serve_app(create_app(settings), port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            trajs = [f"real-tin-{i}" for i in range(3)]
            for traj in trajs:
                await _agent(c, traj)
            generated = kept = calls_kept = 0
            for traj in trajs:
                calls = (await c.get(f"/trajectories/{traj}")).json()["calls"]
                assert len(calls) == 5 and all(x["status"] == "ok" for x in calls)
                assert [x["mismatch_pos"] for x in calls] == [None] * 5
                assert {x["branch"] for x in calls} == {0}  # one line of conversation
                calls_kept += sum(1 for x in calls if x["kept_len"])
                samples = (await c.get(f"/trajectories/{traj}/samples")).json()["data"]
                assert len(samples) == 1
                s = samples[0]
                own = [t for t, m in zip(s["token_ids"], s["loss_mask"], strict=True) if m]
                want = [t for x in calls for t in x["completion_ids"]]
                assert own == want
                lps = [lp for lp, m in zip(s["logprobs"], s["loss_mask"], strict=True) if m]
                assert lps == [lp for x in calls for lp in x["completion_logprobs"]]
                generated += len(want)
                kept += len(own)
            # the forced calls are re-rendered inside <tool_call> tags: token in was needed
            assert calls_kept >= len(trajs)
            await _viewer_reads_it_as_the_tokenizer_does(c, trajs, tiny_model_dir)
            print(f"real vLLM tool agents: {kept}/{generated} generated tokens under loss "
                  f"mask 1 ({kept / generated:.0%}), {calls_kept} calls ran on the record")
    finally:
        await stop_app(server, task)
