"""A plain OpenAI tool-calling agent with two real local tools, run through the gateway.

The harness knows nothing about the gateway: it reads ``OPENAI_BASE_URL`` like any OpenAI
program. Give it a trajectory-scoped URL and every call is recorded under that id::

    export OPENAI_BASE_URL=http://127.0.0.1:8000/g/step0-p0/t/step0-p0-0/v1
    python examples/openai_tool_loop.py --task "find the function that parses dates"

Tools (both really run, in a scratch directory):

- ``search_files(query)``: case-insensitive search over a small project tree;
- ``run_python(code)``: runs ``code`` in a fresh ``python -I`` subprocess with a timeout.

Whatever the model sends (arguments that are not JSON, unknown tools, code that does not
compile) becomes a tool message the model can read, as in a real RL harness. The loop
ends when the model answers without a tool call, or after ``--max-turns``. The last line
printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from openai import OpenAI

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search_files",
        "description": "Search the project files for a word or phrase (case-insensitive).",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_python",
        "description": "Run a Python snippet and return its stdout and stderr.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}},
]

PROJECT = {
    "app/dates.py": "from datetime import date\n\ndef parse_date(text):\n"
                    "    y, m, d = text.split('-')\n    return date(int(y), int(m), int(d))\n",
    "app/report.py": "def total(rows):\n    return sum(r['amount'] for r in rows)\n",
    "README.md": "A tiny accounting app: dates, totals and reports.\n",
}
MAX_OUTPUT = 2000  # characters of tool output given back to the model


def make_project(root: Path) -> None:
    for rel, text in PROJECT.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def search_files(root: Path, query: str) -> str:
    needle = query.strip().lower()
    if not needle:
        return "error: empty query"
    hits = [f"{p.relative_to(root)}:{n}: {line.strip()}"
            for p in sorted(root.rglob("*")) if p.is_file()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if needle in line.lower()]
    return "\n".join(hits[:20]) or f"no match for {query!r}"


def run_python(root: Path, code: str, timeout_s: float = 5.0) -> str:
    try:
        proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=root, timeout=timeout_s,
                              capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s"
    return f"exit code {proc.returncode}\n{proc.stdout}{proc.stderr}"


def call_tool(root: Path, name: str, arguments: str) -> str:
    """Run one tool call; every malformed call becomes an error message, never a crash."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: arguments are not JSON ({exc})"
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    if name == "search_files":
        out = search_files(root, str(args.get("query", "")))
    elif name == "run_python":
        out = run_python(root, str(args.get("code", "")))
    else:
        out = f"error: unknown tool {name!r}"
    return out[:MAX_OUTPUT]


def run_episode(client: OpenAI, model: str, task: str, root: Path, max_turns: int,
                max_tokens: int, seed: int | None = None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": task},
    ]
    tool_calls = 0
    for turn in range(1, max_turns + 1):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
            seed=None if seed is None else seed + turn - 1)
        msg = reply.choices[0].message
        # echo the assistant turn exactly as received: arguments verbatim, never re-serialized
        turn_msg: dict[str, Any] = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            turn_msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in msg.tool_calls if c.type == "function"]
        messages.append(turn_msg)
        if not msg.tool_calls:
            return {"turns": turn, "tool_calls": tool_calls, "answer": msg.content or ""}
        for c in msg.tool_calls:
            if c.type != "function":
                continue
            tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": call_tool(root, c.function.name, c.function.arguments)})
    return {"turns": max_turns, "tool_calls": tool_calls, "answer": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--task", default="Find where dates are parsed and check it on 2024-02-29.")
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL"),
                    help="default: $OPENAI_MODEL, else the first model the endpoint lists")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, help="sampling seed of the first turn (+1 per turn)")
    args = ap.parse_args(argv)
    # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment, as in any OpenAI program
    client = OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    model = args.model or client.models.list().data[0].id
    with tempfile.TemporaryDirectory(prefix="agent-") as tmp:
        root = Path(tmp)
        make_project(root)
        summary = run_episode(client, model, args.task, root, args.max_turns, args.max_tokens,
                              args.seed)
    print(json.dumps({"base_url": str(client.base_url), "model": model, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
