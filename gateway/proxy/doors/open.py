"""Which door a call comes through, and its translation built from the request."""

from __future__ import annotations

from typing import Any

from gateway.proxy.bodies import parse_door
from gateway.proxy.doors import Translation
from gateway.proxy.doors.gemini import GeminiCall, parse_gemini
from gateway.proxy.doors.memory import ResponseMemory
from gateway.proxy.doors.messages import MessagesCall
from gateway.proxy.doors.responses import ResponsesCall


def open_door(door: str, raw: bytes, memory: ResponseMemory, *, max_depth: int,
              path_model: str | None = None, alt: str | None = None
              ) -> tuple[dict[str, Any], Translation]:
    """The client's body and the translation of a call through ``door``: ``responses``,
    ``messages``, ``gemini`` or ``gemini_stream`` (whose model is the path's
    ``path_model``, streamed as SSE when ``alt`` is ``sse``)."""
    if door in ("gemini", "gemini_stream"):
        body = parse_gemini(raw, path_model, max_depth=max_depth)
        return body, GeminiCall(body, memory, stream=door == "gemini_stream",
                                sse=alt == "sse")
    body = parse_door(raw, max_depth=max_depth)
    call = ResponsesCall(body, memory) if door == "responses" else MessagesCall(body, memory)
    return body, call
