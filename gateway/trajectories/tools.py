"""Tool outcomes parsed from the messages a harness appends between two calls.

Following Libra's extraction: each tool result becomes a state (tool name, payload size
class, success / failure / timeout) that predictors key on. The parse is heuristic by
nature (harnesses format errors freely); the rules favour precision on timeouts and
tracebacks, the two outcomes that predict a long tail.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Outcome = Literal["success", "failure", "timeout"]
SizeClass = Literal["small", "medium", "large"]

_TIMEOUT = re.compile(r"\b(timed? ?out|timeout|deadline exceeded)\b", re.IGNORECASE)
_FAILURE = re.compile(
    r"(Traceback \(most recent call last\)|\b\w*(Error|Exception)\b:|\berror:|\bfailed\b|"
    r"exit code [1-9]|returncode=[1-9]|command not found|No such file)",
    re.IGNORECASE,
)
SMALL_MAX_TOKENS = 256
MEDIUM_MAX_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    tool: str
    payload_tokens: int
    size: SizeClass
    outcome: Outcome

    @property
    def state(self) -> str:
        """The key a causal prefix tree uses for this step."""
        return f"{self.tool}:{self.size}:{self.outcome}"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "".join(p for p in parts if isinstance(p, str))
    return ""


def size_class(tokens: int) -> SizeClass:
    if tokens <= SMALL_MAX_TOKENS:
        return "small"
    return "medium" if tokens <= MEDIUM_MAX_TOKENS else "large"


def classify(text: str) -> Outcome:
    head = text[:4000]
    tail = text[-2000:] if len(text) > 4000 else ""
    if _TIMEOUT.search(head) or _TIMEOUT.search(tail):
        return "timeout"
    if _FAILURE.search(head) or _FAILURE.search(tail):
        return "failure"
    return "success"


def _tool_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    names: dict[str, str] = {}
    for msg in messages:
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(call.get("id"), str):
                names[call["id"]] = str(fn.get("name", "tool"))
    return names


def after_last_assistant(messages: Sequence[Any]) -> int:
    """Index just past the last assistant message (0 when there is none)."""
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        if isinstance(msg, Mapping) and msg.get("role") == "assistant":
            return i + 1
    return 0


def new_messages(messages: Sequence[Any]) -> list[Mapping[str, Any]]:
    """The messages after the last assistant turn: what the harness added since then."""
    start = after_last_assistant(messages)
    if start == 0:
        return []
    return [m for m in messages[start:] if isinstance(m, Mapping)]


def parse_outcomes(messages: Sequence[Any]) -> list[ToolOutcome]:
    """Tool outcomes in the messages appended since the previous assistant turn.

    ``tool`` / ``function`` role messages count as tool results; so does a ``user``
    message right after an assistant turn in harnesses that return observations as user
    text (SWE-agent style), named ``observation``.
    """
    fresh = new_messages(messages)
    names = _tool_names([m for m in messages if isinstance(m, Mapping)])
    out: list[ToolOutcome] = []
    for msg in fresh:
        role = msg.get("role")
        if role not in ("tool", "function", "user"):
            continue
        if role == "user" and out:
            continue
        text = _text(msg.get("content"))
        tool = msg.get("name") or names.get(str(msg.get("tool_call_id")), None)
        tool = str(tool) if tool else ("observation" if role == "user" else "tool")
        tokens = max(1, len(text) // 4)
        out.append(ToolOutcome(tool, tokens, size_class(tokens), classify(text)))
    return out
