"""The door protocol: a client wire format in front of one chat-completions call.

Every door turns its request into a chat-completions body, which the proxy schedules,
relays and captures exactly like a chat call (the policy sees one kind of call), and
turns the chat answer (whole or streamed) back into the client's format. Token capture
happens on the chat answer, so it is identical for every door.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import GatewayError
from gateway.proxy.capture import Capture


@dataclass(slots=True)
class Exchange:
    """One call through a door: the chat body to send and how to answer the client."""

    chat_body: dict[str, Any]
    #: tool_call ids the client marked as failed (Anthropic ``is_error``)
    failed_tools: set[str] = field(default_factory=set)

    def whole(self, payload: dict[str, Any], capture: Capture) -> bytes:
        raise NotImplementedError

    def stream_event(self, payload: dict[str, Any], capture: Capture) -> bytes:
        raise NotImplementedError

    def stream_end(self, capture: Capture) -> bytes:
        raise NotImplementedError

    def error_event(self, exc: GatewayError) -> bytes:
        raise NotImplementedError

    def error_body(self, exc: GatewayError) -> bytes:
        raise NotImplementedError


class Door(Protocol):
    name: str  #: the endpoint name records and metrics carry
    path: str  #: the client-facing path suffix, e.g. ``/v1/responses``

    def open(self, body: dict[str, Any], trajectory_id: str) -> Exchange:
        """Translate the client's ``body``; a 400 naming what is unsupported."""
        ...


def sse(event: str, data: dict[str, Any]) -> bytes:
    import orjson

    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def chat_usage(capture: Capture) -> tuple[int, int]:
    """(prompt, completion) token counts: usage when upstream sent it, else capture."""
    usage = capture.usage or {}
    prompt = usage.get("prompt_tokens")
    comp = usage.get("completion_tokens")
    if not isinstance(prompt, int):
        prompt = len(capture.prompt_ids or ())
    if not isinstance(comp, int):
        comp = len(capture.completion(0).token_ids)
    return prompt, comp
