"""Bounded store of finished responses' conversations, for ``previous_response_id``.

A Responses client may send only the new items and point at its previous response; the
gateway then needs the full chat conversation that response ended. Entries expire after
``ttl_s`` and the oldest go first past ``size`` entries; a lookup of an unknown or
expired id (or one from another trajectory) is a clear 400.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from gateway.errors import BadRequest


class ResponseStore:
    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[float, str, list[dict[str, Any]]]] = OrderedDict()

    def put(self, response_id: str, trajectory_id: str, messages: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = (time.monotonic(), trajectory_id, messages)
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str, trajectory_id: str) -> list[dict[str, Any]]:
        item = self._items.get(response_id)
        if item is not None and time.monotonic() - item[0] > self.ttl_s:
            del self._items[response_id]
            item = None
        if item is None or item[1] != trajectory_id:
            raise BadRequest(f"previous_response_id {response_id!r} is unknown or expired "
                             "(send the full input instead)", param="previous_response_id")
        return list(item[2])

    def __len__(self) -> int:
        return len(self._items)
