"""A tool loop on the Anthropic Messages API (streaming), pointed at the gateway by
environment, the way Claude-style harnesses are:

    ANTHROPIC_BASE_URL=http://gateway:8000/t/my-traj ANTHROPIC_API_KEY=any \\
        python examples/anthropic_agent.py --model qwen3-14b

Prints a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import anthropic

TOOLS = [{"name": "run", "description": "Run a shell command in the project",
          "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}},
                           "required": ["cmd"]}}]


def run_tool(cmd: str) -> tuple[str, bool]:
    """A stand-in for a sandbox: the test suite fails until the fix is described."""
    return (f"$ {cmd}\nFAILED tests/test_dates.py::test_leap - ValueError", True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--task", default="tests/test_dates.py fails. Investigate.")
    ap.add_argument("--max-turns", type=int, default=3)
    args = ap.parse_args(argv)
    client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
    messages: list[dict[str, Any]] = [{"role": "user", "content": args.task}]
    tool_calls, turns, answer = 0, 0, None
    for turn in range(args.max_turns):
        last = turn == args.max_turns - 1
        with client.messages.stream(model=args.model, max_tokens=512, system="You fix bugs.",
                                    messages=messages, tools=TOOLS,
                                    tool_choice={"type": "none" if last else "any"}) as s:
            reply = s.get_final_message()
        turns += 1
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            answer = "".join(b.text for b in reply.content if b.type == "text")
            break
        results = []
        for use in uses:
            tool_calls += 1
            out, failed = run_tool(str(use.input.get("cmd", "")))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": out,
                            "is_error": failed})
        messages.append({"role": "user", "content": results})
    print(json.dumps({"base_url": os.environ.get("ANTHROPIC_BASE_URL"), "model": args.model,
                      "turns": turns, "tool_calls": tool_calls, "answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
