"""Front doors: wire formats the gateway serves besides OpenAI chat and completions.

A door turns its request into a chat-completions body (so capture, scheduling and
accounting are the same for every door: the policy sees one kind of call) and turns the
chat answer, whole or streamed, back into its own wire format. The engine is always
asked through ``/v1/chat/completions``, whose token ids and logprobs the gateway already
captures exactly; see docs/real-vllm-wire-format.md for why not the engine's own
``/v1/responses`` and ``/v1/messages``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import orjson

from gateway.errors import BadRequest, GatewayError, UpstreamError
from gateway.trajectories.tools import ToolOutcome


class Translation(Protocol):
    """One call through a door: built from the request, answers in the door's format."""

    chat_body: dict[str, Any]

    def adjust_outcomes(self, outcomes: list[ToolOutcome]) -> list[ToolOutcome]: ...

    def whole(self, chat: dict[str, Any]) -> bytes:
        """The door's answer from a whole chat completion (already stripped)."""
        ...

    def event(self, chunk: dict[str, Any]) -> bytes:
        """SSE bytes for one chat stream chunk (already stripped)."""
        ...

    def done(self) -> bytes:
        """SSE bytes closing the stream."""
        ...

    def error_body(self, exc: GatewayError) -> bytes: ...

    def error_event(self, exc: GatewayError) -> bytes: ...


class DoorStream:
    """Chat-completions SSE bytes in (already captured and stripped by the relay's
    decoder, continuations included), the door's own events out."""

    def __init__(self, door: Translation) -> None:
        self._door = door
        self._buf = b""
        self._done = False

    def feed(self, chunk: bytes) -> bytes:
        buf = self._buf + chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        self._buf = buf[end + 2:]
        return b"".join(self._event(ev) for ev in buf[:end].split(b"\n\n") if ev)

    def flush(self) -> bytes:
        rest, self._buf = self._buf.strip(), b""
        return self._event(rest) if rest else b""

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or self._done:
            return b""
        data = event[5:].strip()
        if data == b"[DONE]":
            self._done = True
            return self._door.done()
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""
        if not isinstance(payload, dict):
            return b""
        if "error" in payload and "choices" not in payload:
            err = payload["error"] if isinstance(payload["error"], dict) else {}
            return self._door.error_event(UpstreamError(str(err.get("message", "error"))))
        return self._door.event(payload)


def sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def text_of(content: Any, *, kinds: tuple[str, ...]) -> str:
    """The text of a content field: a string, or a list of typed parts of ``kinds``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                if part.get("type") in kinds and isinstance(part.get("text"), str):
                    out.append(part["text"])
                else:
                    unsupported(part.get("type"))
        return "".join(out)
    unsupported(type(content).__name__)
    return ""


def unsupported(kind: Any) -> None:
    raise BadRequest(f"content part type {kind!r} is not supported by this gateway "
                     "(text only)", param="content")


def failed_results(outcomes: list[ToolOutcome], chat_body: dict[str, Any],
                   error_ids: set[str]) -> list[ToolOutcome]:
    """``outcomes`` (of the call's fresh tool results) with those the door's format
    marked as errors (``error_ids``: their tool call ids) made failures, whatever their
    text says."""
    if not error_ids:
        return outcomes
    fresh = [m for m in chat_body["messages"] if m.get("role") == "tool"]
    errs = [m.get("tool_call_id") in error_ids for m in fresh[-len(outcomes):]]
    return [dataclasses.replace(o, outcome="failure") if bad else o
            for o, bad in zip(outcomes, errs + [False] * (len(outcomes) - len(errs)),
                              strict=False)]
