"""The Responses and Messages front doors with the official SDKs, token capture exact."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

from tests.harnesses.trace import assert_exact_trace

MODEL = "qwen3-14b"
RESP_TOOLS = [{"type": "function", "name": "bash", "description": "run a shell command",
               "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                              "required": ["cmd"]}}]
CLAUDE_TOOLS = [{"name": "bash", "description": "run a shell command",
                 "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                  "required": ["cmd"]}}]
COMPUTER = {"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
            "environment": "linux"}


def _tid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_responses_sdk_tools_stream_and_previous_response_id(sim_pool, gateway_at, db_url):
    traj = _tid("resp")
    with gateway_at(db_url, sim_pool) as gw, openai.OpenAI(
            base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY", max_retries=0) as client:
        first = client.responses.create(
            model=MODEL, instructions="You fix bugs.", input="tests/test_x.py fails; fix it",
            tools=RESP_TOOLS, tool_choice="required", max_output_tokens=300)
        calls = [o for o in first.output if o.type == "function_call"]
        assert first.status == "completed" and calls and calls[0].name == "bash"
        assert "token_ids" not in (first.model_extra or {})
        with client.responses.stream(
                model=MODEL, instructions="You fix bugs.", previous_response_id=first.id,
                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                        "output": "1 passed"}],
                tools=RESP_TOOLS, tool_choice="none", max_output_tokens=300) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert deltas and "".join(deltas) == final.output_text
        assert final.usage is not None and final.usage.output_tokens > 0
        got = assert_exact_trace(gw, traj, calls=2, texts=["", final.output_text])
        assert {c["endpoint"] for c in got} == {"responses"}
        # the same conversation sent as full input (the Agents SDK way) extends it too
        third = client.responses.create(
            model=MODEL, instructions="You fix bugs.",
            input=[{"role": "user", "content": "tests/test_x.py fails; fix it"},
                   *[o.model_dump(exclude_none=True) for o in first.output],
                   {"type": "function_call_output", "call_id": calls[0].call_id,
                    "output": "1 passed"},
                   {"role": "assistant", "content": final.output_text},
                   {"role": "user", "content": "thanks"}],
            tools=RESP_TOOLS, tool_choice="none", max_output_tokens=300)
        assert third.output_text
        assert_exact_trace(gw, traj, calls=3)


def test_messages_sdk_tools_and_streaming(sim_pool, gateway_at, db_url):
    traj = _tid("claude")
    with gateway_at(db_url, sim_pool) as gw, anthropic.Anthropic(
            base_url=f"{gw}/t/{traj}", api_key="sk-ant-none", max_retries=0) as client:
        msgs: list[dict] = [{"role": "user", "content": "tests fail; fix them"}]
        first = client.messages.create(model=MODEL, max_tokens=300, system="You fix bugs.",
                                       messages=msgs, tools=CLAUDE_TOOLS,
                                       tool_choice={"type": "any"})
        uses = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and uses and uses[0].name == "bash"
        assert isinstance(uses[0].input, dict)
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": "Traceback: boom", "is_error": True}]}]
        with client.messages.stream(model=MODEL, max_tokens=300, system="You fix bugs.",
                                    messages=msgs, tools=CLAUDE_TOOLS,
                                    tool_choice={"type": "none"}) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.content[0].text == text
        assert final.stop_reason in ("end_turn", "max_tokens")
        assert final.usage.output_tokens > 0
        got = assert_exact_trace(gw, traj, calls=2, texts=["", text])
        assert {c["endpoint"] for c in got} == {"messages"}
        live = httpx.get(f"{gw}/trajectories/{traj}").json()["live"]
        assert live is not None


def test_anthropic_key_header_tags_the_trajectory(sim_pool, gateway_at, sqlite_url):
    traj = _tid("keyed")
    with gateway_at(sqlite_url, sim_pool) as gw, anthropic.Anthropic(
            base_url=gw, api_key=traj, max_retries=0) as client:
        client.messages.create(model=MODEL, max_tokens=10,
                               messages=[{"role": "user", "content": "hi"}])
        assert_exact_trace(gw, traj, calls=1)


@pytest.mark.parametrize(("body", "missing"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}], "max_tokens": 5}, "'image'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
])
def test_messages_unsupported_shapes_get_anthropic_400_and_no_trace(
        sim_pool, gateway_at, sqlite_url, body, missing):
    traj = _tid("bad")
    with gateway_at(sqlite_url, sim_pool) as gw:
        r = httpx.post(f"{gw}/t/{traj}/v1/messages", json={"model": MODEL, **body})
        assert r.status_code == 400
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert missing in err["error"]["message"]
        assert httpx.get(f"{gw}/trajectories/{traj}").status_code == 404
        if "max_tokens" in body:  # (the SDK itself refuses a call without it)
            with anthropic.Anthropic(base_url=f"{gw}/t/{traj}", api_key="x", max_retries=0
                                     ) as client, \
                    pytest.raises(anthropic.BadRequestError, match=missing):
                client.messages.create(model=MODEL, **body)


@pytest.mark.parametrize(("body", "missing"), [
    ({"input": "hi", "tools": [COMPUTER]}, "computer_use_preview"),
    ({"input": [{"type": "input_image", "image_url": "http://x/y.png"}]}, "input_image"),
    ({}, "input"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "resp_unknown"),
])
def test_responses_unsupported_shapes_get_openai_4xx_and_no_trace(
        sim_pool, gateway_at, sqlite_url, body, missing):
    traj = _tid("badr")
    with gateway_at(sqlite_url, sim_pool) as gw:
        r = httpx.post(f"{gw}/t/{traj}/v1/responses", json={"model": MODEL, **body})
        assert r.status_code in (400, 404)
        assert missing in r.json()["error"]["message"]
        assert httpx.get(f"{gw}/trajectories/{traj}").status_code == 404
