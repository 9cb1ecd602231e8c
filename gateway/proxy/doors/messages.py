"""The Anthropic Messages API (``POST /v1/messages``) over a chat-completions engine.

Supported: ``system`` (string or text blocks), text, ``tool_use`` and ``tool_result``
blocks (``is_error`` results count as tool failures for the policies), client tools
(``name`` / ``description`` / ``input_schema``), ``tool_choice``, ``max_tokens``,
``stop_sequences``, sampling fields, and streaming with Anthropic's event sequence.
Server tools (web search, code execution, ...) and image or document blocks answer 400
in Anthropic's error shape, naming what is missing. ``thinking`` blocks are dropped.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import orjson

from gateway.errors import BadRequest, GatewayError, anthropic_error_body
from gateway.proxy.doors import sse
from gateway.proxy.doors.memory import ResponseMemory
from gateway.trajectories.tools import ToolOutcome

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
         "function_call": "tool_use", "abort": "end_turn"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of blocks", param=where)
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadRequest(f"{where}[{j}]: block type {kind!r} is not supported here by "
                             "this gateway (text only)", param=where)
        out.append(str(block.get("text", "")))
    return "".join(out)


def _arguments(block: dict[str, Any], memory: ResponseMemory) -> str:
    """The tool call's arguments as the engine wrote them, when the client's ``input`` is
    that same object; else the input serialized."""
    value = block.get("input") or {}
    raw = memory.arguments(str(block.get("id")))
    if raw is not None:
        try:
            if orjson.loads(raw) == value:
                return raw
        except orjson.JSONDecodeError:
            pass
    return orjson.dumps(value).decode()


def _convert(messages: Any, memory: ResponseMemory) -> tuple[list[dict[str, Any]], set[str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    out: list[dict[str, Any]] = []
    errors: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param=where)
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or an array of blocks",
                             param=where)
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name", ""), "arguments": _arguments(block, memory)}})
            elif kind == "tool_result" and m["role"] == "user":
                tid = str(block.get("tool_use_id"))
                if block.get("is_error") is True:
                    errors.add(tid)
                body = block.get("content")
                out.append({"role": "tool", "tool_call_id": tid,
                            "content": "" if body is None
                            else _text(body, f"{where}.content[{j}].content")})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise BadRequest(f"{where}.content[{j}]: block type {kind!r} is not "
                                 "supported by this gateway (text, tool_use, tool_result)",
                                 param=where)
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out, errors


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") \
                or "input_schema" not in t:
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise BadRequest(f"tools[{i}]: tool type {kind!r} is not supported by this "
                             "gateway (client tools with an input_schema only)", param="tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")


class MessagesCall:
    def __init__(self, body: dict[str, Any], memory: ResponseMemory) -> None:
        self.request = body
        self.memory = memory
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool) \
                or body["max_tokens"] < 1:
            raise BadRequest("'max_tokens' is required and must be a positive integer",
                             param="max_tokens")
        messages, self.error_ids = _convert(body.get("messages"), memory)
        system = body.get("system")
        if system:
            messages = [{"role": "system", "content": _text(system, "system")}, *messages]
        chat: dict[str, Any] = {"model": body["model"], "messages": messages,
                                "max_tokens": body["max_tokens"]}
        if body.get("tools"):
            chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("stop_sequences"):
            chat["stop"] = body["stop_sequences"]
        for key in ("temperature", "top_p", "top_k"):
            if key in body:
                chat[key] = body[key]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat_body = chat
        self._started = False
        self._block = -1  # index of the open content block
        self._open: str | None = None  # "text" or "tool"
        self._tool_index: dict[int, int] = {}  # chat tool-call index -> block index
        self._tool_ids: dict[int, str] = {}
        self._tool_args: dict[int, list[str]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}

    def adjust_outcomes(self, outcomes: list[ToolOutcome]) -> list[ToolOutcome]:
        """``is_error`` tool results are failures whatever their text says."""
        if not self.error_ids:
            return outcomes
        fresh = [m for m in self.chat_body["messages"] if m.get("role") == "tool"]
        errs = [m.get("tool_call_id") in self.error_ids for m in fresh[-len(outcomes):]]
        return [dataclasses.replace(o, outcome="failure") if bad else o
                for o, bad in zip(outcomes, errs + [False] * (len(outcomes) - len(errs)),
                                  strict=False)]

    def _message(self, content: list[dict[str, Any]], stop: str | None,
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        u = usage or {}
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.request["model"], "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": int(u.get("prompt_tokens") or 0),
                          "output_tokens": int(u.get("completion_tokens") or 0)}}

    def whole(self, chat: dict[str, Any]) -> bytes:
        choice = (chat.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for c in msg.get("tool_calls") or ():
            fn = c.get("function") or {}
            tool_id = c.get("id") or f"toolu_{uuid.uuid4().hex}"
            if isinstance(fn.get("arguments"), str):
                self.memory.put_arguments(tool_id, fn["arguments"])
            content.append({"type": "tool_use", "id": tool_id,
                            "name": fn.get("name", ""), "input": _json(fn.get("arguments"))})
        stop = _STOP.get(choice.get("finish_reason") or "stop", "end_turn")
        return orjson.dumps(self._message(content, stop, chat.get("usage")))

    # ------------------------------------------------------------------ stream
    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._block})

    def event(self, chunk: dict[str, Any]) -> bytes:
        out = b""
        if not self._started:
            self._started = True
            out += sse("message_start", {"type": "message_start",
                                         "message": self._message([], None, None)})
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta") or {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open != "text":
                    out += self._close()
                    self._block += 1
                    self._open = "text"
                    out += sse("content_block_start", {
                        "type": "content_block_start", "index": self._block,
                        "content_block": {"type": "text", "text": ""}})
                out += sse("content_block_delta", {
                    "type": "content_block_delta", "index": self._block,
                    "delta": {"type": "text_delta", "text": text}})
            for tc in delta.get("tool_calls") or ():
                if not isinstance(tc, dict):
                    continue
                idx = int(tc.get("index", 0))
                if idx not in self._tool_index:
                    out += self._close()
                    self._block += 1
                    self._open = "tool"
                    self._tool_index[idx] = self._block
                    fn = tc.get("function") or {}
                    self._tool_ids[idx] = tc.get("id") or f"toolu_{uuid.uuid4().hex}"
                    out += sse("content_block_start", {
                        "type": "content_block_start", "index": self._block,
                        "content_block": {"type": "tool_use", "id": self._tool_ids[idx],
                                          "name": fn.get("name", ""), "input": {}}})
                args = (tc.get("function") or {}).get("arguments")
                if isinstance(args, str) and args:
                    self._tool_args.setdefault(idx, []).append(args)
                    out += sse("content_block_delta", {
                        "type": "content_block_delta", "index": self._tool_index[idx],
                        "delta": {"type": "input_json_delta", "partial_json": args}})
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        return out

    def done(self) -> bytes:
        out = b"" if self._started else self.event({})
        out += self._close()
        for idx, tool_id in self._tool_ids.items():
            self.memory.put_arguments(tool_id, "".join(self._tool_args.get(idx, [])))
        stop = _STOP.get(self._finish or "stop", "end_turn")
        out += sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": int(self._usage.get("completion_tokens") or 0)}})
        return out + sse("message_stop", {"type": "message_stop"})

    def error_body(self, exc: GatewayError) -> bytes:
        return anthropic_error_body(exc.status_code, exc.message)

    def error_event(self, exc: GatewayError) -> bytes:
        return sse("error", orjson.loads(anthropic_error_body(exc.status_code, exc.message)))


def _json(raw: Any) -> Any:
    if not isinstance(raw, str) or not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"_raw": raw}
