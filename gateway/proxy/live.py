"""Which calls have an upstream request open, on which engine, whether an engine
abort of each could be continued token-in (``gateway.proxy.continuation``), and whether
its engine was told to abort it for abort-and-continue (only such an abort is
continued; one for another reason, an engine shutting down, goes to the client)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.runtime import Runtime

#: Request fields that make a call impossible to continue token-in.
BLOCKING_FIELDS = ("tools", "functions", "response_format", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar", "structured_outputs", "echo",
                   "prompt_logprobs", "suffix")
def continuable(body: dict[str, Any]) -> bool:
    """True if an aborted generation of ``body`` can be finished token-in."""
    if (body.get("n") or 1) != 1 or body.get("best_of") not in (None, 1):
        return False
    for key in BLOCKING_FIELDS:
        value = body.get(key)
        if key == "tools" and value and body.get("tool_choice") == "none":
            continue
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if value not in (None, False, [], {}):
            return False
    return True


@dataclass(slots=True)
class LiveCall:
    backend_id: str
    continuable: bool
    #: Called with the new weight version when engines frozen in ``keep`` resume.
    on_version: Callable[[str], None] | None = None
    #: Its engine was told to abort for abort-and-continue while it ran: an abort (or
    #: an unfinished end) of its generation is the pause's, to be continued.
    aborted: bool = False


class LiveCalls:
    """Calls with an upstream request open, by id: which engine, continuable or not."""

    def __init__(self) -> None:
        self._calls: dict[str, LiveCall] = {}

    def add(self, call_id: str, backend_id: str, body: dict[str, Any],
            on_version: Callable[[str], None] | None = None) -> None:
        self._calls[call_id] = LiveCall(backend_id, continuable(body), on_version)

    def new_version(self, version: str) -> None:
        """Frozen calls go on with new weights: let each record where that starts."""
        for call in self._calls.values():
            if call.on_version is not None:
                call.on_version(version)

    def mark_aborted(self, backend_id: str) -> None:
        """``backend_id`` is about to abort its requests for abort-and-continue."""
        for call in self._calls.values():
            if call.backend_id == backend_id:
                call.aborted = True

    def aborted(self, call_id: str) -> bool:
        call = self._calls.get(call_id)
        return call is not None and call.aborted

    def continued(self, call_id: str) -> None:
        """The continuation is sent: a later abort needs a later pause."""
        call = self._calls.get(call_id)
        if call is not None:
            call.aborted = False

    def remove(self, call_id: str) -> None:
        self._calls.pop(call_id, None)

    def blocking(self, backend_id: str) -> int:
        """How many calls on ``backend_id`` cannot be continued after an abort."""
        return sum(1 for c in self._calls.values()
                   if c.backend_id == backend_id and not c.continuable)

    def __len__(self) -> int:
        return len(self._calls)


def live_calls(rt: Runtime) -> LiveCalls:
    found = rt.extras.get("live_calls")
    if not isinstance(found, LiveCalls):
        found = rt.extras["live_calls"] = LiveCalls()
    return found
