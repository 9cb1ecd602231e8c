"""Agent frameworks and harnesses run unmodified through the gateway, leaving exact traces.

The OpenAI Agents SDK with its default (Responses) model and a function tool; LiteLLM's
client; and mini-swe-agent (installed from PyPI) as a subprocess, the way a user runs it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import litellm
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI

from tests.harnesses.trace import assert_exact_trace

MODEL = "qwen3-14b"


def _tid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_openai_agents_sdk_default_responses_model_with_a_function_tool(
        sim_pool, gateway_at, sqlite_url):
    traj = _tid("agents")
    ran: list[str] = []

    @function_tool
    def run_tests(path: str) -> str:
        """Run the test suite at ``path`` and return its summary."""
        ran.append(path)
        return "3 passed"

    async def main(gw: str) -> str:
        client = AsyncOpenAI(base_url=f"{gw}/t/{traj}/v1", api_key="EMPTY", max_retries=0)
        agent = Agent(name="fixer", instructions="You fix failing tests.", tools=[run_tests],
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=300))
        try:
            result = await Runner.run(agent, "tests/test_x.py fails; fix it", max_turns=30,
                                      run_config=RunConfig(tracing_disabled=True))
        finally:
            await client.close()
        return str(result.final_output)

    with gateway_at(sqlite_url, sim_pool) as gw:
        final = asyncio.run(main(gw))
        assert ran and final  # the tool ran, then the model answered in text
        got = assert_exact_trace(gw, traj)
        assert len(got) >= 2 and {c["endpoint"] for c in got} == {"responses"}


def test_litellm_client(sim_pool, gateway_at, sqlite_url):
    traj = _tid("litellm")
    with gateway_at(sqlite_url, sim_pool) as gw:
        msgs = [{"role": "user", "content": "what is 2+2? use python"}]
        texts = []
        for _ in range(2):
            r = litellm.completion(model=f"openai/{MODEL}", api_base=f"{gw}/t/{traj}/v1",
                                   api_key="EMPTY", messages=msgs, max_tokens=300)
            text = r.choices[0].message.content
            texts.append(text)
            msgs += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "the tool printed 4"}]
        assert_exact_trace(gw, traj, calls=2, texts=texts)


def test_mini_swe_agent_subprocess(sim_pool, gateway_at, sqlite_url, tmp_path: Path):
    """mini-swe-agent from PyPI, run as its CLI: every step it takes is a call traced with
    exact tokens (the simulated model's commands are nonsense words; the agent runs them
    in a scratch directory, they fail, and it goes on until its step limit)."""
    traj = _tid("mini")
    mini = Path(sys.executable).with_name("mini")
    with gateway_at(sqlite_url, sim_pool) as gw:
        env = {**os.environ, "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
               "MSWEA_SILENT_STARTUP": "1", "HOME": str(tmp_path)}
        proc = subprocess.run(
            [str(mini), "-m", f"openai/{MODEL}", "-t", "make tests/test_x.py pass", "-y",
             "--exit-immediately", "-o", str(tmp_path / "traj.json"),
             "-c", "mini.yaml", "-c", "agent.step_limit=3", "-c", "agent.cost_limit=0",
             "-c", f"model.model_kwargs.api_base={gw}/t/{traj}/v1",
             "-c", "model.model_kwargs.api_key=EMPTY",
             "-c", "model.model_kwargs.max_tokens=300"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
            stdin=subprocess.DEVNULL)
        calls = httpx.get(f"{gw}/trajectories/{traj}").json().get("calls", [])
        assert len(calls) >= 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert_exact_trace(gw, traj)
