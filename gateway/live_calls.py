"""Which calls have an upstream request open, on which engine, and what a weight update
does to each.

For every call with an upstream request open: its engine, whether an engine abort of it
could be continued token-in (``gateway.proxy.continuation``), whether it streams, when
its last token arrived, and whether the gateway had its engine abort it for a weight
update (only such an abort is continued or restarted; one for another reason, an engine
shutting down, goes to the client).

A weight update treats the calls of one engine as follows (``gateway.weights.update``):

* a call whose client has seen nothing (not streamed) is always aborted, so its answer
  carries the engine's exact token count, and finished after resume: token-in when it
  can be continued, sent again from the start when it cannot (tool parsing, structured
  output, ``n > 1``): every token then comes from the new weights;
* a stream is aborted and continued in ``abort-and-continue`` mode when it can be
  continued, and frozen in place (vLLM ``keep``) otherwise, or when the mode is
  ``keep``; a frozen stream's boundary is the tokens it had received when its engine
  is resumed, once its stream has been quiet (nothing can come from a paused engine but
  what it made before the pause).

The engine's ids for a call are ``chatcmpl-<call id>`` and ``cmpl-<call id>-0`` (the
gateway sends ``request_id``; vLLM numbers a completions request's prompts), so single
requests can be aborted by name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def engine_ids(call_id: str) -> list[str]:
    """The names vLLM gives a call's requests (the call and its continuations): chat
    ``chatcmpl-<request_id>``; completions ``cmpl-<request_id>-<prompt index>``."""
    return [f"chatcmpl-{call_id}", f"cmpl-{call_id}-0", f"cmpl-{call_id}"]


@dataclass(slots=True)
class LiveCall:
    backend_id: str
    continuable: bool
    stream: bool
    #: Called with the engine's new weight label when the engine resumes: records that
    #: the tokens from the ones received so far on come from it.
    on_version: Callable[[str], None] | None = None
    #: Its engine was told to abort it for a weight update while it ran: an abort (or
    #: an unfinished end) of its generation is the update's, to be continued.
    aborted: bool = False
    #: ... and that abort's end arrived: the engine's own count is the boundary.
    answered: bool = False
    #: time.monotonic() of the last token event relayed (streams)
    last_token: float = 0.0
    trajectory_id: str = ""

    @property
    def frozen(self) -> bool:
        """A stream its engine keeps in place over a pause (not aborted)."""
        return self.stream and not self.aborted


class LiveCalls:
    """Calls with an upstream request open, by id."""

    def __init__(self) -> None:
        self._calls: dict[str, LiveCall] = {}
        #: engines paused for a weight update and not resumed yet: the pause mode sent
        self.paused: dict[str, str] = {}
        #: engines paused with ``wait``: the streams that had begun when the pause
        #: answered (run to their end on the old weights, whatever the relay has sent)
        self.finished: dict[str, set[str]] = {}

    def add(self, call_id: str, backend_id: str, body: dict[str, Any],
            on_version: Callable[[str], None] | None = None, trajectory_id: str = "") -> None:
        self._calls[call_id] = LiveCall(backend_id, continuable(body),
                                        body.get("stream") is True, on_version,
                                        trajectory_id=trajectory_id)

    def of(self, trajectory_id: str) -> dict[str, list[str]]:
        """The open calls of ``trajectory_id``, by backend id."""
        out: dict[str, list[str]] = {}
        for cid, c in self._calls.items():
            if c.trajectory_id == trajectory_id:
                out.setdefault(c.backend_id, []).append(cid)
        return out

    def on(self, backend_id: str) -> dict[str, LiveCall]:
        """The calls open on ``backend_id``."""
        return {cid: c for cid, c in self._calls.items() if c.backend_id == backend_id}

    def got_tokens(self, call_id: str) -> None:
        call = self._calls.get(call_id)
        if call is not None:
            call.last_token = time.monotonic()

    def mark_aborted(self, call_ids: list[str]) -> None:
        """Their engine is about to abort them for a weight update."""
        for cid in call_ids:
            call = self._calls.get(cid)
            if call is not None:
                call.aborted = True

    def aborted(self, call_id: str) -> bool:
        call = self._calls.get(call_id)
        return call is not None and call.aborted

    def answered(self, call_id: str) -> None:
        """The abort's end of an aborted call arrived."""
        call = self._calls.get(call_id)
        if call is not None and call.aborted:
            call.answered = True

    def continued(self, call_id: str) -> None:
        """The continuation is sent: a later abort needs a later pause."""
        call = self._calls.get(call_id)
        if call is not None:
            call.aborted = call.answered = False

    def remove(self, call_id: str) -> None:
        self._calls.pop(call_id, None)

    def blocking(self, backend_id: str) -> int:
        """How many calls on ``backend_id`` cannot be continued after an abort."""
        return sum(1 for c in self._calls.values()
                   if c.backend_id == backend_id and not c.continuable)

    def __len__(self) -> int:
        return len(self._calls)

