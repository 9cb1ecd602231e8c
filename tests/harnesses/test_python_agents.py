"""Python agent frameworks the gateway does not own, run as shipped over a scripted
simulated vLLM server, each configured with nothing but base URL, API key and model name:

- pydantic-ai: ``Agent`` on ``OpenAIChatModel`` with its vLLM provider and a function tool.
  It re-sends the model's tool calls with the arguments re-serialized compactly
  (``{"city":"x"}`` for the model's ``{"city": "x"}``), ``content: null``.
- smolagents: ``ToolCallingAgent`` on ``OpenAIModel`` (``tool_choice: "required"``, stop
  strings, content as lists of parts). It re-sends each tool call as assistant *text*
  (``Calling tools:\\n[{... Python repr ...}]``) and each observation as a user message.

Both re-render the model's earlier turns, so with token in on the engine runs on the
recorded tokens (``kept_len`` on every continuing call) and a run is one branch whose
sample keeps every generated token. With token in off each re-rendered turn leaves the
record: the call forks a branch with a mismatch, and the tokens are kept all the same, one
branch per call.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from backends.sim.chat import ToolCall, render_tool_call
from backends.sim.tokenizer import get_tokenizer
from tests.harnesses.conftest import MODEL
from tests.harnesses.trace import assert_every_token_kept
from tests.servers import LoopThread

TASK = "What is the weather in Paris and in Rome?"
TOKEN_IN = pytest.mark.parametrize("token_in", [True, False], ids=["token_in", "token_in_off"])
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])


@contextmanager
def _gateway(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory,
             script: tuple[bool | ToolCall, ...], *, token_in: bool) -> Iterator[str]:
    """A simulated server that follows ``script`` (per assistant turn in the request: call
    a tool or answer in text) and a gateway (SQLite) in front of it."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig
    from gateway.app import create_app
    from tests.gateway.conftest import make_settings
    from tests.servers import app_in_thread

    cm = start_sim_servers([SimServerConfig(model=MODEL, speed=50, seed=7,
                                            output_len_median=20, tool_script=script)])
    urls = loop_thread.run(cm.__aenter__())
    db = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('pyagents') / 'gw.db'}"
    settings = make_settings(db, urls)
    settings.capture.token_in = token_in
    try:
        with ExitStack() as stack:
            yield stack.enter_context(app_in_thread(loop_thread, lambda: create_app(settings)))
    finally:
        loop_thread.run(cm.__aexit__(None, None, None))


def _check(gw: str, traj: str, *, calls: int, token_in: bool, name: str
           ) -> list[dict[str, Any]]:
    """Every call answered, every generated token kept; one branch with token in (each
    continuing call ran on the record), one branch per call without it (each re-rendered
    turn forks, with its mismatch recorded)."""
    got = httpx.get(f"{gw}/trajectories/{traj}", timeout=10).json()["calls"]
    assert [c["seq"] for c in got] == list(range(calls))
    assert all(c["status"] == "ok" for c in got), [c["error"] for c in got]
    kept = assert_every_token_kept(gw, traj)
    print(kept.line(f"{name} (sim, token in {'on' if token_in else 'off'})"))
    assert kept.calls == calls and kept.kept == kept.generated > 0
    if token_in:
        # one conversation, no side call: pydantic-ai makes none by default; smolagents
        # makes planning calls only with planning_interval set, and its tool-less "final
        # answer" call only when max_steps runs out (either would be a branch of its own)
        assert kept.branches == 1 and kept.on_record == calls - 1
        for prev, cur in itertools.pairwise(got):
            record = prev["prompt_len"] + len(prev["completion_ids"])
            assert cur["kept_len"] == record == cur["prompt_offset"]
            assert cur["branch"] == 0 and cur["mismatch_pos"] is None
    else:
        assert kept.branches == calls and kept.on_record == 0
        for prev, cur in itertools.pairwise(got):
            assert (cur["branch"], cur["parent_branch"]) == (prev["branch"] + 1, prev["branch"])
            # the fork is inside the model's turn the harness re-rendered, or on the
            # template's newline just before it when the echo starts with one (smolagents'
            # "\nCalling tools:"): a byte-level BPE, as Qwen3's, makes "\n\n" one token
            assert prev["prompt_len"] - 1 <= cur["mismatch_pos"] == cur["prompt_offset"] \
                < prev["prompt_len"] + len(prev["completion_ids"])
    return got


def _engine_ran(gw: str, traj: str) -> str:
    """The prompt the engine ran for the last call: its branch's sample up to that call's
    completion, decoded."""
    sample = httpx.get(f"{gw}/trajectories/{traj}/sample", timeout=10).json()
    return get_tokenizer().decode(sample["token_ids"][:sample["calls"][-1]["completion_start"]])


@TOKEN_IN
@STREAM
def test_pydantic_ai_tool_agent_keeps_every_generated_token(
        loop_thread, tmp_path_factory, token_in, stream):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.vllm import VLLMProvider

    traj = "pydantic-ai-" + uuid.uuid4().hex[:8]
    ran: list[str] = []

    def weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    async def run(gw: str) -> str:
        model = OpenAIChatModel(MODEL, provider=VLLMProvider(
            base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY"))
        agent = Agent(model, instructions="Be brief.", tools=[weather])
        async with agent:  # closes the provider's HTTP client
            if not stream:
                return (await agent.run(TASK)).output
            async with agent.run_stream(TASK) as result:
                return await result.get_output()

    # two tool turns (the simulator picks the tool and fakes its argument), then text
    with _gateway(loop_thread, tmp_path_factory, (True, True), token_in=token_in) as gw:
        output = asyncio.run(run(gw))
        calls = _check(gw, traj, calls=3, token_in=token_in,
                       name="pydantic-ai" + (", streamed" if stream else ""))
        ran_text = _engine_ran(gw, traj)

    assert len(ran) == 2 and isinstance(output, str) and output
    tok = get_tokenizer()
    # the tool ran on what the engine generated, and the answer is the engine's last turn
    for call, city in zip(calls, ran, strict=False):
        assert json.dumps({"city": city}) in tok.decode(call["completion_ids"])
    assert output in tok.decode(calls[-1]["completion_ids"])
    # pydantic-ai sent its compact re-serialization; the engine ran the model's own tokens
    compact = json.dumps({"city": ran[0]}, separators=(",", ":"))
    assert (compact in ran_text) is not token_in
    assert (json.dumps({"city": ran[0]}) in ran_text) is token_in


@TOKEN_IN
@STREAM
def test_smolagents_tool_calling_agent_keeps_every_generated_token(
        loop_thread, tmp_path_factory, token_in, stream):
    from smolagents import OpenAIModel, ToolCallingAgent, tool

    traj = "smolagents-" + uuid.uuid4().hex[:8]
    ran: list[str] = []

    @tool
    def weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        ran.append(city)
        return f"sunny in {city}"

    # smolagents ends a run only through its final_answer tool, and offers it with every
    # request (tool_choice "required"), so the script names each call: the weather tool
    # twice, then final_answer (a free pick between the two could end the run at once)
    answer = "Sunny in Paris and in Rome."
    script = (ToolCall("weather", json.dumps({"city": "Paris"})),
              ToolCall("weather", json.dumps({"city": "Rome"})),
              ToolCall("final_answer", json.dumps({"answer": answer})))
    with _gateway(loop_thread, tmp_path_factory, script, token_in=token_in) as gw:
        model = OpenAIModel(model_id=MODEL, api_base=f"{gw}/t/{traj}/v1", api_key="EMPTY")
        try:
            agent = ToolCallingAgent(tools=[weather], model=model, max_steps=5,
                                     stream_outputs=stream)
            output = agent.run(TASK)
        finally:
            model.client.close()
        calls = _check(gw, traj, calls=3, token_in=token_in,
                       name="smolagents" + (", streamed" if stream else ""))
        ran_text = _engine_ran(gw, traj)

    assert ran == ["Paris", "Rome"] and output == answer
    assert [s.tool_calls[0].name for s in agent.memory.steps[1:]] == \
        ["weather", "weather", "final_answer"]
    tok = get_tokenizer()
    assert answer in tok.decode(calls[-1]["completion_ids"])
    # smolagents sent each tool call back as assistant text and each observation as a user
    # turn; with token in the engine ran the model's own tool-call tokens in their place
    assert "<|im_start|>user\nObservation:\nsunny in Rome" in ran_text
    assert ("Calling tools:" in ran_text) is not token_in
    assert (render_tool_call("weather", json.dumps({"city": "Rome"})) in ran_text) is token_in
