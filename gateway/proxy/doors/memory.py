"""What ``previous_response_id`` refers to: the conversation a stored response ended;
and the exact argument strings of generated tool calls (see ``put_arguments``).

Bounded (``size`` responses, least recently used out first) and expiring (``ttl_s``): a
Responses client that chains turns by id gets the full context back; one that sends the
full input (the Agents SDK's default) needs none of it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any


class ResponseMemory:
    def __init__(self, size: int = 10_000, ttl_s: float = 3600.0) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[float, list[dict[str, Any]]]] = OrderedDict()
        self._args: OrderedDict[str, str] = OrderedDict()

    def put_arguments(self, tool_call_id: str, raw: str) -> None:
        """The exact argument string the engine generated for a tool call: Anthropic
        clients send back the parsed ``input``, whose re-serialization may differ from it
        (spacing, key order), which would re-tokenize the history differently."""
        self._args[tool_call_id] = raw
        while len(self._args) > self.size:
            self._args.popitem(last=False)

    def arguments(self, tool_call_id: str) -> str | None:
        return self._args.get(tool_call_id)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = (time.monotonic(), messages)
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        item = self._items.get(response_id)
        if item is None:
            return None
        stamp, messages = item
        if time.monotonic() - stamp > self.ttl_s:
            del self._items[response_id]
            return None
        self._items.move_to_end(response_id)
        return messages

    def __len__(self) -> int:
        return len(self._items)
