"""An OpenAI Agents SDK agent with one function tool, run through the gateway.

The Agents SDK's default model speaks the Responses API; the gateway serves it at
``/v1/responses`` and records every turn with exact tokens. Nothing gateway-specific is
in the script: it reads ``OPENAI_BASE_URL`` like any OpenAI program::

    export OPENAI_BASE_URL=http://127.0.0.1:8000/t/agents-0/v1 OPENAI_API_KEY=EMPTY
    python examples/agents_sdk_agent.py --model qwen3-14b

Tracing export to OpenAI is turned off (the gateway keeps the traces). The last line
printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from agents import Agent, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

INVENTORY = {"apples": 3, "pears": 0, "plums": 12}
calls: list[str] = []


@function_tool
def stock(item: str) -> str:
    """How many of an item are in stock."""
    calls.append(item)
    count = INVENTORY.get(item.strip().lower())
    return f"{count} {item} in stock" if count is not None else f"error: unknown item {item!r}"


async def run(model: str, task: str, max_turns: int) -> dict[str, object]:
    agent = Agent(name="shopkeeper", instructions="Answer from the stock tool.", model=model,
                  tools=[stock])
    try:
        result = await Runner.run(agent, task, max_turns=max_turns)
    except MaxTurnsExceeded:
        return {"model": model, "tool_calls": len(calls), "answer": None,
                "stopped": "max_turns"}
    return {"model": model, "tool_calls": len(calls), "answer": result.final_output,
            "stopped": "answer"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--task", default="Do we have plums?")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args()
    set_tracing_disabled(True)
    print(json.dumps(asyncio.run(run(args.model, args.task, args.max_turns))))


if __name__ == "__main__":
    main()
