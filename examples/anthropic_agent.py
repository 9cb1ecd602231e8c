"""A tool-using agent on the ``anthropic`` SDK, run through the gateway's Messages door.

The script knows nothing about the gateway: it reads ``ANTHROPIC_BASE_URL`` like any
Anthropic program. Give it a trajectory-scoped base (no ``/v1``: the SDK adds
``/v1/messages``) and every turn is recorded under that id with exact tokens::

    export ANTHROPIC_BASE_URL=http://127.0.0.1:8000/t/claude-0 ANTHROPIC_API_KEY=EMPTY
    python examples/anthropic_agent.py --model qwen3-14b --task "what is in the project?"

One real tool, ``list_files(pattern)``, globs a small scratch project. The loop streams
each answer, runs the tool calls, sends the results back as ``tool_result`` blocks and
ends on an answer without tool use or after ``--max-turns``. The last line printed is a
JSON summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import anthropic

TOOLS = [{"name": "list_files", "description": "List project files matching a glob.",
          "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}},
                           "required": ["pattern"]}}]
FILES = ("app/dates.py", "app/report.py", "README.md")


def list_files(root: Path, pattern: Any) -> tuple[str, bool]:
    if not isinstance(pattern, str) or not pattern.strip():
        return "error: pattern must be a non-empty string", True
    try:
        hits = sorted(str(p.relative_to(root)) for p in root.glob(pattern.strip()))
    except (ValueError, NotImplementedError) as exc:
        return f"error: {exc}", True
    return "\n".join(hits) or f"no file matches {pattern!r}", False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--task", default="Which files does the project have?")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args()
    client = anthropic.Anthropic()  # ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
    messages: list[dict[str, Any]] = [{"role": "user", "content": args.task}]
    turns = tool_calls = 0
    answer = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel in FILES:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("# " + rel + "\n")
        while turns < args.max_turns:
            with client.messages.stream(model=args.model, max_tokens=512, tools=TOOLS,
                                        system="You explore codebases.",
                                        messages=messages) as stream:
                msg = stream.get_final_message()
            turns += 1
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in msg.content]})
            uses = [b for b in msg.content if b.type == "tool_use"]
            if not uses:
                answer = "".join(b.text for b in msg.content if b.type == "text")
                break
            results = []
            for use in uses:
                tool_calls += 1
                out, failed = list_files(root, use.input.get("pattern"))
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": out,
                                "is_error": failed})
            messages.append({"role": "user", "content": results})
    print(json.dumps({"model": args.model, "turns": turns, "tool_calls": tool_calls,
                      "answer": answer, "stopped": "answer" if answer is not None
                      else "max_turns"}))


if __name__ == "__main__":
    main()
