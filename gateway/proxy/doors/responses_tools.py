"""The tools of a Responses request as a chat engine sees them, and the engine's tool calls
back as the Responses items the client expects.

- ``function`` tools pass as they are.
- ``namespace`` tools (a named group of functions, as Codex CLI sends its sub-agent
  tools) are flattened: each member becomes the function ``{namespace}__{name}``; a call
  of it goes back as a ``function_call`` item with ``name`` and ``namespace`` apart.
- ``custom`` (freeform) tools become a function with one string parameter ``input``; a
  call goes back as a ``custom_tool_call`` item carrying that string. The tool's grammar
  is not enforced (the engine's tool-call parser has no such constraint).
- Hosted tools (web search, file search, code interpreter, image generation, remote
  MCP, tool search) run on OpenAI's servers, which a vLLM pool does not have: they are
  dropped from what the engine sees, so the model never calls them, and the rest of the
  request works as without them.
- Anything else (computer use, whose loop feeds screenshots back; ``local_shell``) is a
  400 naming the type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import BadRequest

SEP = "__"
HOSTED = frozenset({"file_search", "code_interpreter", "image_generation", "mcp",
                    "tool_search"})
#: Input items that record a hosted tool's work: nothing for the engine to re-read.
HOSTED_ITEMS = frozenset({"web_search_call", "file_search_call", "code_interpreter_call",
                          "image_generation_call", "mcp_list_tools", "mcp_call",
                          "tool_search_call", "tool_search_output"})
_CUSTOM_PARAMS = {"type": "object", "properties": {"input": {
    "type": "string", "description": "The tool's whole input, as free text."}},
    "required": ["input"]}


def is_hosted(kind: Any) -> bool:
    return isinstance(kind, str) and (kind.startswith("web_search") or kind in HOSTED)


def flat_name(name: str, namespace: Any) -> str:
    """The function name the engine knows a (namespaced) tool by."""
    return f"{namespace}{SEP}{name}" if isinstance(namespace, str) and namespace else name


def custom_input(arguments: str) -> str:
    """What a ``custom`` tool receives from the engine's ``{"input": ...}`` arguments
    (the raw string when the model wrote something else)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


@dataclass(frozen=True, slots=True)
class ClientTool:
    """How the client knows a function the engine may call."""

    kind: str  # function | custom
    name: str
    namespace: str | None = None


class ToolMap:
    """The request's tools flattened for the engine, and the way back."""

    def __init__(self, tools: Any) -> None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array", param="tools")
        self.chat_tools: list[dict[str, Any]] = []
        self._known: dict[str, ClientTool] = {}
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise BadRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
            self._add(t, f"tools[{i}]", None)

    def _add(self, t: dict[str, Any], where: str, namespace: str | None) -> None:
        kind = t.get("type")
        name = t.get("name")
        if is_hosted(kind):
            return
        if kind == "namespace" and namespace is None and isinstance(t.get("tools"), list):
            for j, member in enumerate(t["tools"]):
                if not isinstance(member, dict):
                    raise BadRequest(f"{where}.tools[{j}] must be an object",
                                     param=f"{where}.tools[{j}]")
                self._add(member, f"{where}.tools[{j}]", str(name or ""))
            return
        if kind not in ("function", "custom") or not isinstance(name, str) or not name:
            raise BadRequest(f"tool type {kind!r} is not supported by this gateway (function, "
                             "custom and namespace tools; hosted tools are dropped)",
                             param=f"{where}.type")
        params = (t.get("parameters") or {"type": "object"}) if kind == "function" \
            else _CUSTOM_PARAMS
        fn: dict[str, Any] = {"name": flat_name(name, namespace), "parameters": params}
        if t.get("description"):
            fn["description"] = t["description"]
        self.chat_tools.append({"type": "function", "function": fn})
        self._known[fn["name"]] = ClientTool(str(kind), name, namespace)

    def choice(self, choice: Any) -> Any:
        """``tool_choice`` for the engine."""
        if choice in ("auto", "none", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
            name = flat_name(str(choice.get("name", "")), choice.get("namespace"))
            return {"type": "function", "function": {"name": name}}
        raise BadRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")

    def item(self, call: dict[str, Any], item_id: str) -> dict[str, Any]:
        """The Responses output item for one chat tool call (``call['id']`` set)."""
        fn = call.get("function") or {}
        flat, args = str(fn.get("name", "")), str(fn.get("arguments", ""))
        known = self._known.get(flat, ClientTool("function", flat))
        if known.kind == "custom":
            return {"type": "custom_tool_call", "id": item_id, "call_id": call["id"],
                    "name": known.name, "input": custom_input(args), "status": "completed"}
        item = {"type": "function_call", "id": item_id, "call_id": call["id"],
                "name": known.name, "arguments": args, "status": "completed"}
        if known.namespace is not None:
            item["namespace"] = known.namespace
        return item
