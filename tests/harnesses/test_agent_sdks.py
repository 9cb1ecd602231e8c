"""Agent SDKs the gateway does not own, run unmodified over a scripted simulated server:
the OpenAI Agents SDK with its default (Responses) model and a function tool, and
LiteLLM's client. Each must leave an exact token trace."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import httpx
import pytest

from tests.harnesses.conftest import MODEL, check_exact_trace

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no export to OpenAI


def test_openai_agents_sdk_default_responses_model_with_a_function_tool(scripted_gateway):
    from agents import (
        Agent,
        Runner,
        function_tool,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    traj = "agents-" + uuid.uuid4().hex[:8]
    ran: list[str] = []

    @function_tool
    def bash(cmd: str) -> str:
        """Run a shell command."""
        ran.append(cmd)
        return "a.py b.py"

    async def run():
        async with AsyncOpenAI(base_url=f"{scripted_gateway}/t/{traj}/v1",
                               api_key="EMPTY") as client:
            set_default_openai_client(client, use_for_tracing=False)
            agent = Agent(name="coder", instructions="Be brief.", model=MODEL, tools=[bash])
            return await Runner.run(agent, "list the files", max_turns=4)

    set_tracing_disabled(True)
    result = asyncio.run(run())
    assert len(ran) == 1 and isinstance(result.final_output, str) and result.final_output
    calls = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert len(calls) == 1
    check_exact_trace(scripted_gateway, traj, [
        ("", [(calls[0].name, calls[0].arguments)]), (result.final_output, [])])
    detail = httpx.get(f"{scripted_gateway}/trajectories/{traj}").json()
    assert {c["endpoint"] for c in detail["calls"]} == {"responses"}  # the SDK's default


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_client_tool_loop(scripted_gateway, stream):
    import litellm

    traj = "litellm-" + uuid.uuid4().hex[:8]
    tools = [{"type": "function", "function": {
        "name": "bash", "description": "run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]}}}]
    msgs: list[dict] = [{"role": "user", "content": "list the files"}]
    seen = []
    for _ in range(2):
        kw = {"model": f"openai/{MODEL}", "api_base": f"{scripted_gateway}/t/{traj}/v1",
              "api_key": "EMPTY", "messages": msgs, "tools": tools}
        if stream:
            chunks = list(litellm.completion(stream=True, **kw))
            msg = litellm.stream_chunk_builder(chunks, messages=msgs).choices[0].message
        else:
            msg = litellm.completion(**kw).choices[0].message
        calls = msg.tool_calls or []
        seen.append((msg.content or "", [(c.function.name, c.function.arguments)
                                         for c in calls]))
        echoed = {"role": "assistant", "content": msg.content}
        if calls:
            echoed["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in calls]
        msgs = [*msgs, echoed, *[{"role": "tool", "tool_call_id": c.id, "content": "a.py"}
                                 for c in calls]]
    assert seen[0][1] and not seen[1][1] and json.loads(seen[0][1][0][1])
    check_exact_trace(scripted_gateway, traj, seen)
