"""Acceptance: unmodified OpenAI clients through the gateway to simulated vLLM servers.

A 3-turn tool-calling conversation (sync and async client, streaming and not) is
recorded with exact token ids and logprobs, stored as prefix deltas, and rebuilt as one
training sample, on SQLite and on Postgres.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid

import httpx
import openai
import pytest

from backends.sim.tokenizer import IM_END, get_tokenizer

MODEL = "qwen3-14b"
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                   "required": ["cmd"]}}}]


def _tool_reply(msg) -> list[dict]:
    """The harness side of one turn: echo the assistant message, answer its tool calls."""
    echoed = {"role": "assistant", "content": msg.content}
    out = []
    if msg.tool_calls:
        echoed["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments}} for c in msg.tool_calls]
        out = [{"role": "tool", "tool_call_id": c.id, "content": f"ran {c.function.name}: ok"}
               for c in msg.tool_calls]
    else:
        out = [{"role": "user", "content": "go on"}]
    return [echoed, *out]


def _stream_to_message(stream) -> tuple[object, list[int] | None]:
    content, calls = [], {}
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                content.append(ch.delta.content)
            for tc in ch.delta.tool_calls or ():
                cur = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = tc.id or cur["id"]
                if tc.function and tc.function.name:
                    cur["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    cur["arguments"] += tc.function.arguments
    tool_calls = [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function",
        function={"name": c["name"], "arguments": c["arguments"]}) for c in calls.values()]
    return openai.types.chat.ChatCompletionMessage(
        role="assistant", content="".join(content) or None, tool_calls=tool_calls or None), None


def _check_trace(gw: str, traj: str, asked_ids: list[int]) -> None:
    detail = httpx.get(f"{gw}/trajectories/{traj}").json()
    calls = detail["calls"]
    assert [c["seq"] for c in calls] == [0, 1, 2]
    assert all(c["status"] == "ok" for c in calls)
    assert all(c["mismatch_pos"] is None for c in calls)
    # the call whose client asked for token ids saw exactly what was stored
    assert calls[0]["completion_ids"] == asked_ids
    for c in calls:
        assert len(c["completion_logprobs"]) == len(c["completion_ids"]) > 0
        assert all(lp <= 0 for lp in c["completion_logprobs"])
        assert c["backend_id"] in ("b0", "b1") and c["tp"] == 1
    # prefix delta: each call stores only what is new since the previous prompt+completion
    for prev, cur in itertools.pairwise(calls):
        assert cur["prompt_offset"] == prev["prompt_offset"] + len(prev["prompt_delta_ids"]) + \
            len(prev["completion_ids"])
        assert cur["prompt_len"] == cur["prompt_offset"] + len(cur["prompt_delta_ids"])
    sample = httpx.get(f"{gw}/trajectories/{traj}/sample").json()
    total_prompt = sum(len(c["prompt_delta_ids"]) for c in calls)
    total_completion = sum(len(c["completion_ids"]) for c in calls)
    assert len(sample["token_ids"]) == total_prompt + total_completion == \
        calls[-1]["prompt_len"] + len(calls[-1]["completion_ids"])
    assert sum(sample["loss_mask"]) == total_completion
    assert [s["weight_version"] for s in sample["calls"]] == ["0", "0", "0"]
    tok = get_tokenizer()
    eos = tok.encode(IM_END)[0]
    for span in sample["calls"]:
        ids = sample["token_ids"][span["completion_start"]:span["completion_end"]]
        assert ids[-1] == eos or len(ids) > 0  # finished by EOS or length
        assert sample["logprobs"][span["completion_start"]] <= 0


def test_sync_client_three_turns_mixed_streaming(sim_pool, gateway_at, db_url, closing):
    traj = f"demo-{uuid.uuid4().hex[:6]}"
    with gateway_at(db_url, sim_pool) as gw:
        client = closing(openai.OpenAI(base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY",
                                       max_retries=0))
        messages = [{"role": "system", "content": "You fix bugs."},
                    {"role": "user", "content": "The test in tests/test_x.py fails. Fix it."}]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=40,
            extra_body={"return_token_ids": True})
        asked_ids = first.choices[0].model_extra["token_ids"]
        assert first.choices[0].logprobs is None  # injected, then stripped
        messages += _tool_reply(first.choices[0].message)
        stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                max_tokens=40, stream=True)
        msg, _ = _stream_to_message(stream)
        messages += _tool_reply(msg)
        third = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               tool_choice="none", max_tokens=40)
        assert "token_ids" not in (third.choices[0].model_extra or {})
        assert "prompt_token_ids" not in (third.model_extra or {})
        _check_trace(gw, traj, asked_ids)


def test_async_client_three_turns(sim_pool, gateway_at, db_url):
    traj = f"async-{uuid.uuid4().hex[:6]}"

    async def run(gw: str) -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{gw}/g/grp-1/t/{traj}/v1", api_key="EMPTY",
                                    max_retries=0)
        messages = [{"role": "user", "content": "search for the answer"}]
        first = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, extra_body={"return_token_ids": True})
        ids = first.choices[0].model_extra["token_ids"]
        messages += _tool_reply(first.choices[0].message)
        stream = await client.chat.completions.create(model=MODEL, messages=messages,
                                                      stream=True, max_tokens=30)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
        await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
        await client.close()
        return ids

    with gateway_at(db_url, sim_pool) as gw:
        asked = asyncio.run(run(gw))
        _check_trace(gw, traj, asked)
        listed = httpx.get(f"{gw}/trajectories", params={"group_id": "grp-1"}).json()["data"]
        assert traj in [t["id"] for t in listed]
        r = httpx.post(f"{gw}/trajectories/{traj}/finish", json={"reward": 0.5})
        assert r.status_code == 200 and r.json()["reward"] == 0.5
        assert httpx.get(f"{gw}/trajectories/{traj}/sample").json()["reward"] == 0.5


def test_changed_tool_list_opens_a_branch(sim_pool, gateway_at, sqlite_url, closing):
    """Dropping the tools re-renders the system prompt: a real change of history, so the
    call opens a branch forked where the prompts part, and both are samples."""
    traj = f"drift-{uuid.uuid4().hex[:6]}"
    with gateway_at(sqlite_url, sim_pool) as gw:
        client = closing(openai.OpenAI(base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY",
                                       max_retries=0))
        messages = [{"role": "user", "content": "fix it"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                               max_tokens=20)
        messages += _tool_reply(first.choices[0].message)
        # re-rendered without the tools, the prompts part inside the system prompt: a
        # conversation of its own by the main-branch rule (gateway/store/samples.py: the
        # family with the most calls, then the longest sequence), and one call each, so
        # main stays the conversation that carries the tools, however long this answer
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                       extra_body={"ignore_eos": True})
        calls = httpx.get(f"{gw}/trajectories/{traj}").json()["calls"]
        assert [c["mismatch_pos"] for c in calls] == [None, None]  # not drift: a branch
        assert [(c["branch"], c["parent_branch"]) for c in calls] == [(0, None), (1, 0)]
        assert 0 < calls[1]["prompt_offset"] < calls[0]["prompt_len"]
        sample = httpx.get(f"{gw}/trajectories/{traj}/sample").json()
        assert sample["branch"] == 0 and sample["main"] and sample["mismatches"] == []
        assert len(sample["token_ids"]) == calls[0]["prompt_len"] + len(calls[0]["completion_ids"])
        every = httpx.get(f"{gw}/trajectories/{traj}/samples").json()["data"]
        assert [s["branch"] for s in every] == [0, 1]
        assert every[1]["fork_position"] == calls[1]["prompt_offset"]
        assert [s["main"] for s in every] == [True, False]
        for s, call in zip(every, calls, strict=True):  # each turn under loss mask 1 once
            assert s["token_ids"][-len(call["completion_ids"]):] == call["completion_ids"]
            assert sum(s["loss_mask"]) == len(call["completion_ids"])


def test_untagged_call_gets_an_id_and_models_are_aggregated(sim_pool, gateway_at, sqlite_url):
    with gateway_at(sqlite_url, sim_pool) as gw:
        models = httpx.get(f"{gw}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        r = httpx.post(f"{gw}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert r.status_code == 200
        tid = r.headers["x-trajectory-id"]
        assert tid.startswith("auto-")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            got = httpx.get(f"{gw}/trajectories/{tid}")
            if got.status_code == 200:
                break
        assert len(got.json()["calls"]) == 1
        assert json.loads(r.text)["choices"][0]["logprobs"] is None


def test_client_disconnect_aborts_at_the_simulated_engine(sim_pool, gateway_at, sqlite_url):
    def disconnects() -> int:
        return sum(httpx.get(f"{u}/sim/stats").json()["disconnects"] for u in sim_pool)

    before = disconnects()
    with gateway_at(sqlite_url, sim_pool) as gw:
        with httpx.stream("POST", f"{gw}/t/gone-1/v1/chat/completions", json={
                "model": MODEL, "stream": True, "max_tokens": 5000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "write a lot"}]}) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
        deadline = time.monotonic() + 5
        while disconnects() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert disconnects() == before + 1
        running = sum(httpx.get(f"{u}/sim/stats").json()["running"] for u in sim_pool)
        assert running == 0


def test_streamed_usage_is_recorded_without_reaching_a_client_that_did_not_ask(
        sim_pool, gateway_at, sqlite_url):
    traj = f"usage-{uuid.uuid4().hex[:6]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": True}
    with gateway_at(sqlite_url, sim_pool) as gw:
        raw = httpx.post(f"{gw}/t/{traj}/v1/chat/completions", json=body, timeout=30).text
        events = [e for e in raw.split("\n\n") if e.startswith("data: {")]
        assert events and all('"usage":{' not in e for e in events)  # as the client asked
        asked = httpx.post(f"{gw}/t/{traj}-b/v1/chat/completions", timeout=30, json={
            **body, "stream_options": {"include_usage": True}}).text
        assert '"choices":[],' in asked.replace(" ", "") and '"usage":{' in asked.replace(" ", "")
        for tid in (traj, f"{traj}-b"):
            (call,) = httpx.get(f"{gw}/trajectories/{tid}").json()["calls"]
            assert call["usage"]["completion_tokens"] == len(call["completion_ids"]) > 0
            assert call["usage"]["prompt_tokens"] == call["prompt_len"] > 0


def test_extra_choices_keep_their_logprobs(sim_pool, gateway_at, sqlite_url):
    traj = f"n2-{uuid.uuid4().hex[:6]}"
    with gateway_at(sqlite_url, sim_pool) as gw:
        r = httpx.post(f"{gw}/t/{traj}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        (call,) = httpx.get(f"{gw}/trajectories/{traj}").json()["calls"]
        (extra,) = call["extra_choices"]
        assert len(extra["logprobs"]) == len(extra["token_ids"]) > 0
        assert all(lp <= 0 for lp in extra["logprobs"])


def test_an_engine_400_reaches_a_chat_client_in_openai_shape(sim_pool, gateway_at, sqlite_url):
    """vLLM's own error envelope (``type: BadRequestError``, ``code: 400``) is rewritten to
    OpenAI's, with the engine's message; a context overrun says so in ``code``."""
    traj = f"ctx-{uuid.uuid4().hex[:6]}"
    long = "word " * 50_000  # past the simulated engine's 40,960-token context
    with gateway_at(sqlite_url, sim_pool) as gw:
        r = httpx.post(f"{gw}/t/{traj}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": long}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["code"] == "context_length_exceeded"
        assert "maximum context length" in err["message"]
        client = openai.OpenAI(base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="maximum context length") as info:
            client.completions.create(model=MODEL, prompt=long, max_tokens=5)
        assert info.value.code == "context_length_exceeded"
        client.close()
