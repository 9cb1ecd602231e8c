"""Anthropic Messages API (``/v1/messages``) in front of a chat-completions call.

Supported: ``system`` (string or text blocks), text / ``tool_use`` / ``tool_result``
content blocks, tools with ``input_schema``, ``tool_choice``, ``stop_sequences``,
sampling parameters, and streaming (``message_start``, ``content_block_*``,
``message_delta``, ``message_stop``). Other block types (images, documents, thinking)
are a 400 in Anthropic's error shape naming them.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from gateway.errors import BadRequest, GatewayError, anthropic_error_body
from gateway.proxy.capture import Capture
from gateway.proxy.doors.base import Exchange, chat_usage, sse

_PASS = ("temperature", "top_p", "top_k")
_KNOWN = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice",
                    "stop_sequences", "stream", "metadata", "thinking", *_PASS})
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def _error_body(exc: GatewayError) -> bytes:
    return anthropic_error_body(exc.message, exc.status_code)


def _block_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of blocks")
    out = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise BadRequest(f"{where}: content block type {kind!r} is not supported here "
                             "(text only)")
        out.append(str(block.get("text", "")))
    return "".join(out)


def _convert(messages: Any) -> tuple[list[dict[str, Any]], set[str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    out: list[dict[str, Any]] = []
    failed: set[str] = set()
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages[{i}]: role must be 'user' or 'assistant'",
                             param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}]: content must be a string or a list of blocks",
                             param="messages")
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                    "name": str(block.get("name", "")),
                    "arguments": _dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                call_id = str(block.get("tool_use_id", ""))
                if block.get("is_error") is True:
                    failed.add(call_id)
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": _block_text(block.get("content", ""), where)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise BadRequest(f"{where}: block type {kind!r} is not supported in a "
                                 f"{role} message (text, tool_use, tool_result)",
                                 param="messages")
        if role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out, failed


def _dumps(value: Any) -> str:
    """JSON the way Python's json.dumps writes it (vLLM's hermes parser does the same),
    so an echoed tool call renders to the very tokens the model produced."""
    import json

    return json.dumps(value, ensure_ascii=False)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or "input_schema" not in t or t.get("type") not in (
                None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise BadRequest(f"tool type {kind!r} is not supported: only client tools with "
                             "an input_schema", param="tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")


class MessagesDoor:
    name = "messages"
    path = "/v1/messages"

    def open(self, body: dict[str, Any], trajectory_id: str) -> Exchange:
        unknown = sorted(set(body) - _KNOWN)
        if unknown:
            raise BadRequest(f"unsupported Messages parameter(s): {', '.join(unknown)}")
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            raise BadRequest("'max_tokens' is required and must be a positive integer",
                             param="max_tokens")
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            raise BadRequest("extended thinking is not supported", param="thinking")
        msgs, failed = _convert(body.get("messages"))
        system = body.get("system")
        if system:
            msgs.insert(0, {"role": "system", "content": _block_text(system, "system")})
        chat: dict[str, Any] = {"model": body["model"], "messages": msgs,
                                "max_tokens": body["max_tokens"]}
        tools = _tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("stop_sequences"):
            chat["stop"] = list(body["stop_sequences"])
        for key in _PASS:
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return MessagesExchange(chat, failed, model=body["model"])


class MessagesExchange(Exchange):
    def __init__(self, chat_body: dict[str, Any], failed: set[str], *, model: str) -> None:
        super().__init__(chat_body, failed)
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.started = False
        self.block = -1  # index of the open block
        self.block_kind = ""
        self.tool_blocks: dict[int, int] = {}

    def _stop(self, capture: Capture) -> tuple[str, str | None]:
        chat_body = self.chat_body
        cap = capture.completion(0)
        reason = STOP_REASONS.get(cap.finish_reason or "stop", "end_turn")
        if reason == "end_turn" and chat_body.get("stop"):
            return "end_turn", None  # vLLM does not say which stop string matched
        return reason, None

    def whole(self, payload: dict[str, Any], capture: Capture) -> bytes:
        msg = ((payload.get("choices") or [{}])[0]).get("message") or {}
        content: list[dict[str, Any]] = []
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            try:
                args = orjson.loads(fn.get("arguments") or "{}")
            except orjson.JSONDecodeError:
                args = {}
            content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                            "input": args})
        reason, seq = self._stop(capture)
        prompt, comp = chat_usage(capture)
        return orjson.dumps({"id": self.id, "type": "message", "role": "assistant",
                             "model": self.model, "content": content, "stop_reason": reason,
                             "stop_sequence": seq,
                             "usage": {"input_tokens": prompt, "output_tokens": comp}})

    def _start(self, capture: Capture) -> bytes:
        if self.started:
            return b""
        self.started = True
        prompt = len(capture.prompt_ids or ())
        return sse("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": 0}}})

    def _close(self) -> bytes:
        if self.block < 0 or not self.block_kind:
            return b""
        self.block_kind = ""
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.block})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.block += 1
        self.block_kind = kind
        return out + sse("content_block_start", {"type": "content_block_start",
                                                 "index": self.block, "content_block": block})

    def stream_event(self, payload: dict[str, Any], capture: Capture) -> bytes:
        out = [self._start(capture)]
        for choice in payload.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.block_kind != "text":
                    out.append(self._open("text", {"type": "text", "text": ""}))
                out.append(sse("content_block_delta", {
                    "type": "content_block_delta", "index": self.block,
                    "delta": {"type": "text_delta", "text": delta["content"]}}))
            for tc in delta.get("tool_calls") or ():
                idx = int(tc.get("index", 0))
                fn = tc.get("function") or {}
                if idx not in self.tool_blocks:
                    out.append(self._open("tool", {"type": "tool_use", "id": tc.get("id"),
                                                   "name": fn.get("name"), "input": {}}))
                    self.tool_blocks[idx] = self.block
                if fn.get("arguments"):
                    out.append(sse("content_block_delta", {
                        "type": "content_block_delta", "index": self.tool_blocks[idx],
                        "delta": {"type": "input_json_delta",
                                  "partial_json": fn["arguments"]}}))
        return b"".join(out)

    def stream_end(self, capture: Capture) -> bytes:
        reason, seq = self._stop(capture)
        _, comp = chat_usage(capture)
        return b"".join([
            self._start(capture), self._close(),
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": reason, "stop_sequence": seq},
                                  "usage": {"output_tokens": comp}}),
            sse("message_stop", {"type": "message_stop"}),
        ])

    def error_event(self, exc: GatewayError) -> bytes:
        return b"event: error\ndata: " + _error_body(exc) + b"\n\n"

    @staticmethod
    def error_body(exc: GatewayError) -> bytes:
        return _error_body(exc)
