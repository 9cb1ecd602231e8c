"""The Gemini API (``POST /v1beta/models/{model}:generateContent`` and
``:streamGenerateContent``) over a chat-completions engine.

The request side is :mod:`gateway.proxy.doors.gemini_request`. The model is named by the
path, not the body: the door puts it into the chat body as ``model``.

Answers: ``candidates[]`` (one per chat choice; ``content.parts`` with the text and each
``functionCall`` with its ``args`` as an object and the engine's call ``id``),
``finishReason`` (``STOP``; ``MAX_TOKENS`` for a turn cut by ``maxOutputTokens``),
``usageMetadata`` (the engine's prompt and completion counts), ``modelVersion`` (the
model the client named) and ``responseId``.

Streaming with ``?alt=sse`` (what the SDKs and Gemini CLI ask for): ``data:
{GenerateContentResponse}`` events, each with the text the engine produced since the
last; function calls come whole in the last event, with ``finishReason`` and
``usageMetadata``. Without ``alt=sse`` the same responses come as one JSON array, as
Google streams them (``[{...},\\r\\n{...}]``). Errors are Google's ``{"error": {code,
message, status}}``, in a stream as one more event (or array element).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gateway.envelopes import google_error_body
from gateway.errors import GatewayError
from gateway.proxy.capture import merge_tool_call
from gateway.proxy.doors import failed_results
from gateway.proxy.doors.gemini_request import (
    chat_prompt,
    generation,
    parse_gemini,
    remember_arguments,
    tool_choice,
)
from gateway.proxy.doors.memory import ResponseMemory
from gateway.trajectories.tools import ToolOutcome

__all__ = ["GeminiCall", "parse_gemini"]

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP", "abort": "STOP",
           "length": "MAX_TOKENS", "content_filter": "SAFETY"}


class GeminiCall:
    """One ``generateContent`` / ``streamGenerateContent`` call (a :class:`Translation`).

    ``body``: the client's body with the path's model in it (:func:`parse_gemini`);
    ``sse``: stream as server-sent events (``alt=sse``) rather than a JSON array."""

    def __init__(self, body: dict[str, Any], memory: ResponseMemory, *, stream: bool,
                 sse: bool = True) -> None:
        self.request = body
        self.memory = memory
        self.id = uuid.uuid4().hex[:22]
        messages, tools, self.error_ids = chat_prompt(body, memory)
        chat: dict[str, Any] = {"model": body["model"], "messages": messages}
        if tools:
            chat["tools"] = tools
            tool_choice(body, chat)
        generation(body, chat)
        if stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat_body = chat
        self._sse = sse
        self._events = 0  # responses streamed so far (the array form needs separators)
        self._closed = False
        self._calls: dict[int, dict[int, dict[str, Any]]] = {}  # choice -> index -> call
        self._finish: dict[int, str] = {}
        self._usage: dict[str, Any] = {}

    def adjust_outcomes(self, outcomes: list[ToolOutcome]) -> list[ToolOutcome]:
        """functionResponses with an ``error`` key are failures whatever their text says."""
        return failed_results(outcomes, self.chat_body, self.error_ids)

    # ------------------------------------------------------------------ shapes
    def _call_part(self, call: dict[str, Any]) -> dict[str, Any]:
        fn = call.get("function") or {}
        call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
        name = str(fn.get("name", ""))
        raw = fn["arguments"] if isinstance(fn.get("arguments"), str) else ""
        args = remember_arguments(self.memory, call_id, name, raw)
        return {"functionCall": {"id": call_id, "name": name, "args": args}}

    def _response(self, candidates: list[dict[str, Any]],
                  usage: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"candidates": candidates}
        if usage is not None:
            prompt, completion = _count(usage, "prompt_tokens"), _count(usage,
                                                                        "completion_tokens")
            out["usageMetadata"] = {"promptTokenCount": prompt,
                                    "candidatesTokenCount": completion,
                                    "totalTokenCount": prompt + completion}
        out["modelVersion"] = self.request["model"]
        out["responseId"] = self.id
        return out

    def whole(self, chat: dict[str, Any]) -> bytes:
        candidates = []
        for choice in chat.get("choices") or ():
            msg = choice.get("message") or {}
            parts: list[dict[str, Any]] = []
            if msg.get("content"):
                parts.append({"text": msg["content"]})
            parts += [self._call_part(c) for c in msg.get("tool_calls") or ()
                      if isinstance(c, dict)]
            candidates.append(_candidate(parts or [{"text": ""}], choice.get("index", 0),
                                         _FINISH.get(choice.get("finish_reason") or "stop",
                                                     "STOP")))
        return orjson.dumps(self._response(candidates, chat.get("usage") or {}))

    # ------------------------------------------------------------------ stream
    def _frame(self, response: dict[str, Any]) -> bytes:
        data = orjson.dumps(response)
        self._events += 1
        if self._sse:
            return b"data: " + data + b"\r\n\r\n"
        return (b"[" if self._events == 1 else b",\r\n") + data

    def event(self, chunk: dict[str, Any]) -> bytes:
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        candidates = []
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            index = ch.get("index", 0)
            delta = ch.get("delta") or {}
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    merge_tool_call(self._calls.setdefault(index, {}), tc)
            if ch.get("finish_reason"):
                self._finish[index] = ch["finish_reason"]
            text = delta.get("content")
            if isinstance(text, str) and text:
                candidates.append(_candidate([{"text": text}], index))
        return self._frame(self._response(candidates)) if candidates else b""

    def done(self) -> bytes:
        """The last response: whole function calls, ``finishReason``, ``usageMetadata``."""
        if self._closed:
            return b""
        candidates = []
        for index in sorted(set(self._finish) | set(self._calls) or {0}):
            calls = self._calls.get(index, {})
            parts = [self._call_part(calls[k]) for k in sorted(calls)] or [{"text": ""}]
            candidates.append(_candidate(parts, index,
                                         _FINISH.get(self._finish.get(index, "stop"), "STOP")))
        out = self._frame(self._response(candidates, self._usage))
        self._closed = True
        return out if self._sse else out + b"]"

    def error_body(self, exc: GatewayError) -> bytes:
        return google_error_body(exc.status_code, exc.message)

    def error_event(self, exc: GatewayError) -> bytes:
        if self._closed:
            return b""
        out = self._frame(orjson.loads(google_error_body(exc.status_code, exc.message)))
        self._closed = True
        return out if self._sse else out + b"]"


def _candidate(parts: list[dict[str, Any]], index: int, finish: str | None = None
               ) -> dict[str, Any]:
    out: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": index}
    if finish is not None:
        out["finishReason"] = finish
    return out


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
