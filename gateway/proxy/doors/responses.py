"""OpenAI Responses API (``/v1/responses``) in front of a chat-completions call.

Supported: ``input`` as a string or a list of message / ``function_call`` /
``function_call_output`` items, ``instructions``, function tools, ``tool_choice``,
``previous_response_id`` (from the gateway's own bounded store), ``max_output_tokens``,
sampling parameters, and streaming with the events the openai SDK parses. Anything else
(built-in tools, non-text content, structured output formats) is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from gateway.errors import BadRequest, GatewayError, openai_error_body
from gateway.proxy.capture import Capture
from gateway.proxy.doors.base import Exchange, chat_usage, sse
from gateway.proxy.doors.memory import ResponseStore

_PASS = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k")
_IGNORED = frozenset({"store", "metadata", "include", "reasoning", "truncation",
                      "service_tier", "prompt_cache_key", "safety_identifier", "background",
                      "top_logprobs", "stream_options", "text", "model", "input",
                      "instructions", "tools", "tool_choice", "previous_response_id",
                      "max_output_tokens", "stream", *_PASS})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of text parts",
                         param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise BadRequest(f"{where}: content part type {kind!r} is not supported "
                             "(only input_text / output_text)", param="input")
        out.append(str(part.get("text", "")))
    return "".join(out)


def _items_to_messages(items: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"input[{i}]: role {role!r} is not supported", param="input")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")),
                                 "arguments": str(item.get("arguments", "{}"))}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": output if isinstance(output, str)
                         else _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # nothing of it reaches a chat template
        else:
            raise BadRequest(f"input[{i}]: item type {kind!r} is not supported "
                             "(message, function_call, function_call_output)", param="input")
    return msgs, []


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out = []
    for t in tools:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise BadRequest(f"tool type {kind!r} is not supported: only function tools "
                             "(built-in tools such as web_search need OpenAI's servers)",
                             param="tools")
        fn = {"name": t.get("name"), "parameters": t.get("parameters") or
              {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")


class ResponsesDoor:
    name = "responses"
    path = "/v1/responses"

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def open(self, body: dict[str, Any], trajectory_id: str) -> Exchange:
        unknown = sorted(set(body) - _IGNORED)
        if unknown:
            raise BadRequest(f"unsupported Responses parameter(s): {', '.join(unknown)}",
                             param=unknown[0])
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) \
            else None
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise BadRequest(f"text.format {fmt.get('type')!r} is not supported", param="text")
        msgs: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str):
                raise BadRequest("'previous_response_id' must be a string",
                                 param="previous_response_id")
            msgs = [m for m in self.store.get(prev, trajectory_id) if m["role"] != "system"]
        raw = body.get("input")
        if isinstance(raw, str):
            msgs.append({"role": "user", "content": raw})
        elif isinstance(raw, list):
            msgs.extend(_items_to_messages(raw)[0])
        else:
            raise BadRequest("'input' is required (string or array of items)", param="input")
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            msgs.insert(0, {"role": "system", "content": body["instructions"]})
        if not msgs:
            raise BadRequest("'input' must not be empty", param="input")
        chat: dict[str, Any] = {"model": body["model"], "messages": msgs}
        tools = _tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        for key in _PASS:
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return ResponsesExchange(chat, store=self.store, trajectory_id=trajectory_id,
                                 request=body)


class ResponsesExchange(Exchange):
    def __init__(self, chat_body: dict[str, Any], *, store: ResponseStore, trajectory_id: str,
                 request: dict[str, Any]) -> None:
        super().__init__(chat_body)
        self.store = store
        self.trajectory_id = trajectory_id
        self.request = request
        self.id = "resp_" + uuid.uuid4().hex
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.seq = 0
        self.started = False
        self.text_open = False
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool index -> output item
        self.next_index = 0
        self.text_index = -1

    # -- the Response object -------------------------------------------------------
    def _response(self, status: str, output: list[dict[str, Any]],
                  capture: Capture | None) -> dict[str, Any]:
        req = self.request
        usage = None
        incomplete = None
        if capture is not None:
            prompt, comp = chat_usage(capture)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": comp, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + comp}
            if capture.completion(0).finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": req["model"], "output": output, "error": None,
            "incomplete_details": incomplete, "instructions": req.get("instructions"),
            "metadata": req.get("metadata") or {}, "parallel_tool_calls":
                req.get("parallel_tool_calls", True), "temperature": req.get("temperature"),
            "top_p": req.get("top_p"), "tool_choice": req.get("tool_choice") or "auto",
            "tools": req.get("tools") or [], "max_output_tokens": req.get("max_output_tokens"),
            "previous_response_id": req.get("previous_response_id"),
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "usage": usage,
        }

    def _message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        fn = call.get("function") or {}
        return {"type": "function_call", "id": "fc_" + str(call.get("id") or uuid.uuid4().hex),
                "call_id": call.get("id"), "name": fn.get("name"),
                "arguments": fn.get("arguments", ""), "status": status}

    def _remember(self, capture: Capture) -> None:
        cap = capture.completion(0)
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(cap.text) or None}
        if cap.tool_calls:
            msg["tool_calls"] = [cap.tool_calls[i] for i in sorted(cap.tool_calls)]
            if msg["content"] is None:
                msg["content"] = None
        self.store.put(self.id, self.trajectory_id, [*self.chat_body["messages"], msg])

    def whole(self, payload: dict[str, Any], capture: Capture) -> bytes:
        choice = (payload.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        output = []
        if msg.get("content"):
            output.append(self._message_item(msg["content"]))
        output.extend(self._call_item(c) for c in msg.get("tool_calls") or ())
        self._remember(capture)
        return orjson.dumps(self._response("completed", output, capture))

    # -- streaming -----------------------------------------------------------------
    def _ev(self, kind: str, **data: Any) -> bytes:
        out = sse(kind, {"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return out

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        resp = self._response("in_progress", [], None)
        return (self._ev("response.created", response=resp)
                + self._ev("response.in_progress", response=resp))

    def stream_event(self, payload: dict[str, Any], capture: Capture) -> bytes:
        out = [self._start()]
        for choice in payload.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if not self.text_open:
                    self.text_open = True
                    self.text_index = self.next_index
                    self.next_index += 1
                    out.append(self._ev("response.output_item.added",
                                        output_index=self.text_index,
                                        item=self._message_item("", "in_progress")
                                        | {"content": []}))
                    out.append(self._ev("response.content_part.added", item_id=self.msg_id,
                                        output_index=self.text_index, content_index=0,
                                        part={"type": "output_text", "text": "",
                                              "annotations": []}))
                out.append(self._ev("response.output_text.delta", item_id=self.msg_id,
                                    output_index=self.text_index, content_index=0,
                                    delta=text, logprobs=[]))
            for tc in delta.get("tool_calls") or ():
                out.append(self._tool_delta(tc))
        return b"".join(out)

    def _tool_delta(self, tc: dict[str, Any]) -> bytes:
        idx = int(tc.get("index", 0))
        out = []
        item = self.calls.get(idx)
        fn = tc.get("function") or {}
        if item is None:
            out.append(self._close_text())
            item = self.calls[idx] = self._call_item(
                {"id": tc.get("id"), "function": {"name": fn.get("name") or "",
                                                  "arguments": ""}}, "in_progress")
            item["output_index"] = self.next_index
            self.next_index += 1
            out.append(self._ev("response.output_item.added", output_index=item["output_index"],
                                item={k: v for k, v in item.items() if k != "output_index"}))
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            item["arguments"] += args
            out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=item["output_index"], delta=args))
        return b"".join(out)

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        return b""  # closed with its full text at the end (see stream_end)

    def stream_end(self, capture: Capture) -> bytes:
        out = [self._start()]
        cap = capture.completion(0)
        text = "".join(cap.text)
        items: list[tuple[int, dict[str, Any]]] = []
        if self.text_index >= 0:
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(self._ev("response.output_text.done", item_id=self.msg_id,
                                output_index=self.text_index, content_index=0, text=text,
                                logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=self.msg_id,
                                output_index=self.text_index, content_index=0, part=part))
            done = self._message_item(text)
            out.append(self._ev("response.output_item.done", output_index=self.text_index,
                                item=done))
            items.append((self.text_index, done))
        for item in self.calls.values():
            pos = item.pop("output_index")
            item["status"] = "completed"
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"],
                                output_index=pos, name=item["name"],
                                arguments=item["arguments"]))
            out.append(self._ev("response.output_item.done", output_index=pos, item=item))
            items.append((pos, item))
        self._remember(capture)
        resp = self._response("completed", [it for _, it in sorted(items, key=lambda p: p[0])],
                              capture)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        out.append(self._ev(kind, response=resp))
        return b"".join(out)

    def error_event(self, exc: GatewayError) -> bytes:
        return self._ev("error", code=exc.code or exc.error_type, message=exc.message,
                        param=exc.param)

    @staticmethod
    def error_body(exc: GatewayError) -> bytes:
        return openai_error_body(exc.message, error_type=exc.error_type, param=exc.param,
                                 code=exc.code)
