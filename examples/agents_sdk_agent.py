"""An OpenAI Agents SDK agent with a function tool, pointed at the gateway by environment.

    OPENAI_BASE_URL=http://gateway:8000/t/my-traj/v1 OPENAI_API_KEY=EMPTY \\
        python examples/agents_sdk_agent.py --task "..."

The SDK's default model speaks the Responses API; the gateway serves it and records every
turn as an exact token trace. Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from agents import (
    Agent,
    ModelSettings,
    RunConfig,
    Runner,
    function_tool,
    set_default_openai_api,
)
from openai import AsyncOpenAI

FILES = {
    "src/dates.py": "def parse(s):\n    y, m, d = s.split('-')\n"
                    "    return int(y), int(m), int(d)\n",
    "tests/test_dates.py": "from src.dates import parse\n\n"
                           "def test_leap():\n    assert parse('2024-02-29')\n",
}
calls: list[str] = []


@function_tool
def read_file(path: str) -> str:
    """Read a file of the project (src/dates.py or tests/test_dates.py)."""
    calls.append(path)
    return FILES.get(path, f"error: no such file {path!r}; files: {sorted(FILES)}")


async def run(task: str, model: str | None, max_turns: int) -> dict[str, object]:
    set_default_openai_api("responses")  # the SDK's default, said out loud
    client = AsyncOpenAI(api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    try:
        model = model or (await client.models.list()).data[0].id
        agent = Agent(name="fixer", instructions="Read the code, then say what is wrong.",
                      tools=[read_file], model=model,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=512))
        result = await Runner.run(agent, task, max_turns=max_turns,
                                  run_config=RunConfig(tracing_disabled=True))
        return {"base_url": str(client.base_url), "model": model, "tool_calls": len(calls),
                "answer": str(result.final_output)}
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--task", default="tests/test_dates.py fails on 2024-02-29. Why?")
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL"))
    ap.add_argument("--max-turns", type=int, default=20)
    args = ap.parse_args(argv)
    from agents import set_default_openai_client

    set_default_openai_client(AsyncOpenAI(api_key=os.environ.get("OPENAI_API_KEY", "EMPTY")),
                              use_for_tracing=False)
    print(json.dumps(asyncio.run(run(args.task, args.model, args.max_turns))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
