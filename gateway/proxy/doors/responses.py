"""The OpenAI Responses API (``POST /v1/responses``) over a chat-completions engine.

Supported: ``input`` as a string or items (messages with text parts, ``function_call``
and ``function_call_output`` items; ``reasoning`` items are dropped), ``instructions``,
function tools, ``tool_choice``, ``previous_response_id`` (from the gateway's bounded
memory), ``max_output_tokens``, sampling fields, ``text.format`` json_schema, and
streaming with the SDK's event sequence. Built-in tools (web search, file search,
computer use, ...) and non-text inputs answer 400 naming what is missing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from gateway.errors import BadRequest, GatewayError, NotFound, openai_error_body
from gateway.proxy.capture import merge_tool_call
from gateway.proxy.doors import sse, text_of
from gateway.proxy.doors.memory import ResponseMemory
from gateway.trajectories.tools import ToolOutcome

_PASS = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "stop",
         "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")
_TEXT = ("input_text", "output_text", "text")
_STATUS = {"length": ("incomplete", {"reason": "max_output_tokens"})}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _messages_of(items: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message" or (kind is None and "role" in item):
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"input[{i}].role {role!r} is not supported",
                                 param=f"input[{i}].role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": text_of(item.get("content"), kinds=_TEXT)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id") or _new_id("call"),
                    "type": "function", "function": {"name": item.get("name", ""),
                                                     "arguments": item.get("arguments", "")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the turn's text, then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str)
                        else text_of(output, kinds=_TEXT)})
        elif kind == "reasoning":
            continue
        else:
            raise BadRequest(f"input item type {kind!r} is not supported by this gateway "
                             "(messages, function_call, function_call_output)",
                             param=f"input[{i}].type")
    return out


def _tools_of(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise BadRequest(f"tool type {kind!r} is not supported by this gateway "
                             "(function tools only)", param=f"tools[{i}].type")
        fn = {"name": t.get("name"), "parameters": t.get("parameters") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none", "required"):
        return choice
    raise BadRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")


class ResponsesCall:
    def __init__(self, body: dict[str, Any], memory: ResponseMemory) -> None:
        self.request = body
        self.memory = memory
        self.id = _new_id("resp")
        self.created = int(time.time())
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            found = memory.get(str(prev))
            if found is None:
                raise NotFound(f"Previous response with id '{prev}' not found (the gateway "
                               "keeps the most recent responses only; send the full input)",
                               param="previous_response_id")
            history = [m for m in found if m["role"] != "system"]
        raw = body.get("input")
        if isinstance(raw, str):
            fresh = [{"role": "user", "content": raw}]
        elif isinstance(raw, list):
            fresh = _messages_of(raw)
        else:
            raise BadRequest("'input' is required (a string or an array of items)",
                             param="input")
        system = []
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            system = [{"role": "system", "content": body["instructions"]}]
        self.messages = system + history + fresh
        if not self.messages:
            raise BadRequest("'input' must not be empty", param="input")
        chat: dict[str, Any] = {"model": body["model"], "messages": self.messages}
        if body.get("tools"):
            chat["tools"] = _tools_of(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) \
            else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "output"), "schema": fmt.get("schema", {}),
                "strict": fmt.get("strict", False)}}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        for key in _PASS:
            if key in body:
                chat[key] = body[key]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat_body = chat
        # streaming state
        self._seq = 0
        self._text: list[str] = []
        self._msg_id = _new_id("msg")
        self._text_open = False
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def adjust_outcomes(self, outcomes: list[ToolOutcome]) -> list[ToolOutcome]:
        return outcomes

    # ------------------------------------------------------------------ whole
    def _response(self, status: str, output: list[dict[str, Any]],
                  usage: dict[str, Any] | None, incomplete: dict[str, Any] | None
                  ) -> dict[str, Any]:
        b = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": b["model"], "output": output,
            "error": None, "incomplete_details": incomplete,
            "instructions": b.get("instructions"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "max_output_tokens": b.get("max_output_tokens"),
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "text": b.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "store": True, "usage": _usage(usage),
        }

    def _items(self, text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if text or not calls:
            items.append({"type": "message", "id": self._msg_id, "status": "completed",
                          "role": "assistant", "content": [
                              {"type": "output_text", "text": text, "annotations": []}]})
        for c in calls:
            fn = c.get("function") or {}
            items.append({"type": "function_call", "id": _new_id("fc"),
                          "call_id": c.get("id") or _new_id("call"),
                          "name": fn.get("name", ""), "arguments": fn.get("arguments", ""),
                          "status": "completed"})
        return items

    def _remember(self, text: str, calls: list[dict[str, Any]]) -> None:
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                  "function": c.get("function")} for c in calls]
        self.memory.put(self.id, [*self.messages, msg])

    def whole(self, chat: dict[str, Any]) -> bytes:
        choice = (chat.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
        calls = [c for c in msg.get("tool_calls") or [] if isinstance(c, dict)]
        status, incomplete = _STATUS.get(choice.get("finish_reason"), ("completed", None))
        self._remember(text, calls)
        return orjson.dumps(self._response(status, self._items(text, calls),
                                           chat.get("usage"), incomplete))

    # ------------------------------------------------------------------ stream
    def _ev(self, kind: str, **data: Any) -> bytes:
        self._seq += 1
        return sse(kind, {"type": kind, "sequence_number": self._seq - 1, **data})

    def event(self, chunk: dict[str, Any]) -> bytes:
        out = b""
        if self._seq == 0:
            start = self._response("in_progress", [], None, None)
            out += self._ev("response.created", response=start)
            out += self._ev("response.in_progress", response=start)
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta") or {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                if not self._text_open:
                    self._text_open = True
                    out += self._ev("response.output_item.added", output_index=0, item={
                        "type": "message", "id": self._msg_id, "status": "in_progress",
                        "role": "assistant", "content": []})
                    out += self._ev("response.content_part.added", item_id=self._msg_id,
                                    output_index=0, content_index=0, part={
                                        "type": "output_text", "text": "", "annotations": []})
                self._text.append(text)
                out += self._ev("response.output_text.delta", item_id=self._msg_id,
                                output_index=0, content_index=0, delta=text, logprobs=[])
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    merge_tool_call(self._calls, tc)
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        return out

    def done(self) -> bytes:
        out = b"" if self._seq else self.event({})
        text = "".join(self._text)
        calls = [self._calls[i] for i in sorted(self._calls)]
        index = 0
        if self._text_open:
            out += self._ev("response.output_text.done", item_id=self._msg_id,
                            output_index=0, content_index=0, text=text, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": []}
            out += self._ev("response.content_part.done", item_id=self._msg_id,
                            output_index=0, content_index=0, part=part)
            out += self._ev("response.output_item.done", output_index=0, item={
                "type": "message", "id": self._msg_id, "status": "completed",
                "role": "assistant", "content": [part]})
            index = 1
        items = self._items(text, calls)
        for item in items:
            if item["type"] != "function_call":
                continue
            pending = {**item, "arguments": "", "status": "in_progress"}
            out += self._ev("response.output_item.added", output_index=index, item=pending)
            out += self._ev("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=item["arguments"])
            out += self._ev("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=item["arguments"])
            out += self._ev("response.output_item.done", output_index=index, item=item)
            index += 1
        status, incomplete = _STATUS.get(self._finish or "", ("completed", None))
        if not self._text_open and not calls:
            items = []
        self._remember(text, calls)
        final = self._response(status, items, self._usage, incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._ev(kind, response=final)

    def error_body(self, exc: GatewayError) -> bytes:
        return openai_error_body(exc.message, error_type=exc.error_type, param=exc.param,
                                 code=exc.code)

    def error_event(self, exc: GatewayError) -> bytes:
        return self._ev("error", code=exc.code, message=exc.message, param=exc.param)


def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if not u:
        return None
    inp, outp = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"input_tokens": inp, "output_tokens": outp, "total_tokens": inp + outp,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
