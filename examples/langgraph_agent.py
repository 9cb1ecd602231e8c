"""A LangGraph ReAct agent (``langchain-openai`` + ``langgraph``), unmodified, through the gateway.

LangGraph is what many agentic-RL stacks write their agents in (Agent Lightning's SQL
agent, for instance). Nothing here knows about the gateway: ``ChatOpenAI`` reads
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` from the environment like the OpenAI SDK it
wraps, so a trajectory-scoped URL is all it takes::

    pip install langchain-openai langgraph
    export OPENAI_BASE_URL=http://127.0.0.1:8000/g/step0-p0/t/step0-p0-3/v1
    python examples/langgraph_agent.py

The graph is the classic two-node loop: ``agent`` (the chat model with tools bound) and
``tools`` (LangGraph's ``ToolNode``), joined by ``tools_condition``. The tools are the
real ones of ``openai_tool_loop.py`` (file search, Python in a subprocess). The turn
limit is LangGraph's own ``recursion_limit``; reaching it ends the episode, it is not an
error. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

# the script's own folder is on sys.path when it is run as a script
from openai_tool_loop import make_project, run_python, search_files


def make_tools(root: Path) -> list[BaseTool]:
    @tool
    def search_project(query: str) -> str:
        """Search the project files for a word or phrase (case-insensitive)."""
        return search_files(root, query)[:2000]

    @tool
    def python(code: str) -> str:
        """Run a Python snippet and return its stdout and stderr."""
        return run_python(root, code)[:2000]

    return [search_project, python]


def build_agent(llm: ChatOpenAI, tools: list[BaseTool], seed: int | None) -> Any:
    model = llm.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        turn = sum(isinstance(m, AIMessage) for m in state["messages"])
        extra = {} if seed is None else {"seed": seed + turn}
        return {"messages": [model.invoke(state["messages"], **extra)]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def run_episode(app: Any, task: str, max_turns: int) -> dict[str, Any]:
    state: dict[str, Any] = {"messages": [
        SystemMessage("You are a coding agent. Use the tools."), HumanMessage(task)]}
    stopped = "answer"
    try:
        # two graph steps per turn (agent, tools); the limit stops the graph after
        # max_turns agent steps
        for values in app.stream(state, {"recursion_limit": 2 * max_turns},
                                 stream_mode="values"):
            state = values
    except GraphRecursionError:
        stopped = "max_turns"
    ai = [m for m in state["messages"] if isinstance(m, AIMessage)]
    return {"turns": len(ai), "tool_calls": sum(len(m.tool_calls) for m in ai),
            "stopped": stopped, "answer": ai[-1].text if ai and stopped == "answer" else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--task", default="Find where dates are parsed and check it on 2024-02-29.")
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL"),
                    help="default: $OPENAI_MODEL, else the first model the endpoint lists")
    ap.add_argument("--max-turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, help="sampling seed of the first turn (+1 per turn)")
    args = ap.parse_args(argv)
    api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")
    model = args.model
    if model is None:
        from openai import OpenAI

        model = OpenAI(api_key=api_key).models.list().data[0].id
    llm = ChatOpenAI(model=model, api_key=api_key, max_completion_tokens=args.max_tokens,
                     max_retries=0)
    with tempfile.TemporaryDirectory(prefix="agent-") as tmp:
        root = Path(tmp)
        make_project(root)
        app = build_agent(llm, make_tools(root), args.seed)
        summary = run_episode(app, args.task, args.max_turns)
    print(json.dumps({"base_url": os.environ.get("OPENAI_BASE_URL"), "model": model,
                      **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
