"""The OpenAI Responses API (``POST /v1/responses``) over a chat-completions engine.

Supported: ``input`` as a string or items (messages with text parts, ``function_call``,
``custom_tool_call`` and their outputs; ``reasoning`` items and records of hosted tool
calls are dropped), ``instructions``, function, custom and namespace tools (hosted tools
are dropped: see ``responses_tools``), ``tool_choice``, ``previous_response_id`` (from
the gateway's bounded memory), ``max_output_tokens``, sampling fields, ``text.format``
json_schema, logprobs on ``output_text`` parts (``include:
["message.output_text.logprobs"]`` or ``top_logprobs``), and streaming with the SDK's
event sequence. ``store: false`` is honoured: the response is not kept, so no later
``previous_response_id`` finds it (the answer is that of an unknown id, as OpenAI gives
it), and a client that sends its whole input each turn holds no gateway memory.
``reasoning``, ``prompt_cache_key`` and the other fields that only steer OpenAI's own
servers are accepted and echoed or ignored. Non-text inputs answer 400 naming what is
missing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from gateway.envelopes import openai_error_body
from gateway.errors import BadRequest, GatewayError, NotFound, UpstreamError
from gateway.proxy.capture import merge_tool_call
from gateway.proxy.doors import sse, text_of
from gateway.proxy.doors.memory import ResponseMemory
from gateway.proxy.doors.responses_tools import HOSTED_ITEMS, ToolMap, custom_input, flat_name
from gateway.trajectories.tools import ToolOutcome

_PASS = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "stop",
         "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty")
_TEXT = ("input_text", "output_text", "text")
_STATUS = {"length": ("incomplete", {"reason": "max_output_tokens"})}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _messages_of(items: list[Any], memory: ResponseMemory) -> list[dict[str, Any]]:
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
        elif kind in ("function_call", "custom_tool_call"):
            _append_call(out, _call_of(item, memory))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise BadRequest(f"input[{i}].call_id is required for a {kind} item",
                                 param=f"input[{i}].call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str)
                        else text_of(output, kinds=_TEXT)})
        elif kind == "reasoning" or kind in HOSTED_ITEMS:
            continue
        else:
            raise BadRequest(f"input item type {kind!r} is not supported by this gateway "
                             "(messages, function and custom tool calls and their outputs)",
                             param=f"input[{i}].type")
    return out


def _call_of(item: dict[str, Any], memory: ResponseMemory) -> dict[str, Any]:
    """The chat tool call a ``function_call`` / ``custom_tool_call`` item records."""
    call_id = item.get("call_id") or item.get("id") or _new_id("call")
    name = flat_name(str(item.get("name", "")), item.get("namespace"))
    if item.get("type") == "custom_tool_call":
        text = str(item.get("input", ""))
        raw = memory.arguments(str(call_id))  # as the engine wrote it, when still the same
        args = raw if raw is not None and custom_input(raw) == text \
            else orjson.dumps({"input": text}).decode()
    else:
        args = item.get("arguments", "")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _append_call(out: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":  # the turn's text, then calls
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _wants_logprobs(body: dict[str, Any]) -> int | None:
    """``top_logprobs`` when the client asked for logprobs on its output text, else None."""
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise BadRequest("'top_logprobs' must be an integer from 0 to 20",
                         param="top_logprobs")
    include = body.get("include")
    if include is not None and not isinstance(include, list):
        raise BadRequest("'include' must be an array", param="include")
    if "message.output_text.logprobs" in (include or ()) or top:
        return top or 0
    return None


def _logprob(entry: dict[str, Any]) -> dict[str, Any]:
    top = [{"token": t.get("token"), "logprob": t.get("logprob"), "bytes": t.get("bytes")}
           for t in entry.get("top_logprobs") or () if isinstance(t, dict)]
    return {"token": entry.get("token"), "logprob": entry.get("logprob"),
            "bytes": entry.get("bytes"), "top_logprobs": top}


class ResponsesCall:
    def __init__(self, body: dict[str, Any], memory: ResponseMemory) -> None:
        self.request = body
        self.memory = memory
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.tools = ToolMap(body.get("tools") or [])
        self.messages = self._system(body) + self._history(body) + self._fresh(body)
        if not self.messages:
            raise BadRequest("'input' must not be empty", param="input")
        self.top_logprobs = _wants_logprobs(body)
        self.chat_body = self._chat(body)
        # streaming state
        self._seq = 0
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._text_chars = 0
        self._lp_chars = 0  # text covered by the logprobs kept so far
        self._msg_id = _new_id("msg")
        self._text_open = False
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    @staticmethod
    def _system(body: dict[str, Any]) -> list[dict[str, Any]]:
        text = body.get("instructions")
        return [{"role": "system", "content": text}] if isinstance(text, str) and text else []

    def _history(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        prev = body.get("previous_response_id")
        if prev is None:
            return []
        found = self.memory.get(str(prev))
        if found is None:
            raise NotFound(f"Previous response with id '{prev}' not found (the gateway "
                           "keeps the most recent responses only; send the full input)",
                           param="previous_response_id")
        return [m for m in found if m["role"] != "system"]

    def _fresh(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        raw = body.get("input")
        if isinstance(raw, str):
            return [{"role": "user", "content": raw}]
        if isinstance(raw, list):
            return _messages_of(raw, self.memory)
        raise BadRequest("'input' is required (a string or an array of items)", param="input")

    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        chat: dict[str, Any] = {"model": body["model"], "messages": self.messages}
        choice = body.get("tool_choice")
        choice = None if choice is None else self.tools.choice(choice)
        if self.tools.chat_tools:  # (a choice without tools is one the engine refuses)
            chat["tools"] = self.tools.chat_tools
            if choice is not None:
                chat["tool_choice"] = choice
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
        if self.top_logprobs is not None:  # asked by the client: the relay keeps them
            chat["logprobs"] = True
            chat["top_logprobs"] = self.top_logprobs
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        return chat

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
            "top_logprobs": b.get("top_logprobs"),
            "max_output_tokens": b.get("max_output_tokens"),
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "text": b.get("text") or {"format": {"type": "text"}},
            "reasoning": b.get("reasoning") or {"effort": None, "summary": None},
            "truncation": "disabled", "store": self.stored,
            "usage": _usage(usage),
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self._msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": self._logprobs}]}

    def _items(self, text: str, calls: list[dict[str, Any]], status: str
               ) -> list[dict[str, Any]]:
        items = [self._message(text, status)] if text or not calls else []
        for c in calls:
            c["id"] = c.get("id") or _new_id("call")
            items.append(self.tools.item(c, _new_id("fc")))
        return items

    @property
    def stored(self) -> bool:
        """Whether the client lets the response be kept (``store``, true by default)."""
        return self.request.get("store", True) is not False

    def _remember(self, text: str, calls: list[dict[str, Any]]) -> None:
        """Keep the conversation for ``previous_response_id``, unless ``store: false``;
        the raw argument strings of its tool calls either way (small, and a client that
        does not store sends the calls back in its next input)."""
        msg: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                  "function": c.get("function")} for c in calls]
            for c in calls:  # a custom tool's input comes back parsed: keep the raw string
                args = (c.get("function") or {}).get("arguments")
                if isinstance(args, str) and c.get("id"):
                    self.memory.put_arguments(str(c["id"]), args)
        if self.stored:
            self.memory.put(self.id, [*self.messages, msg])

    def _keep_logprobs(self, lp: Any, text_chars: int) -> list[dict[str, Any]]:
        """The entries of a chat ``logprobs`` that cover output text up to ``text_chars``
        (a tool call's tokens and the end-of-turn token are no part of ``output_text``)."""
        if self.top_logprobs is None or not isinstance(lp, dict):
            return []
        kept = []
        for entry in lp.get("content") or ():
            if self._lp_chars >= text_chars or not isinstance(entry, dict):
                break
            kept.append(_logprob(entry))
            self._lp_chars += len(str(entry.get("token") or "")) or 1
        self._logprobs.extend(kept)
        return kept

    def whole(self, chat: dict[str, Any]) -> bytes:
        choice = (chat.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
        calls = [c for c in msg.get("tool_calls") or [] if isinstance(c, dict)]
        status, incomplete = _STATUS.get(choice.get("finish_reason"), ("completed", None))
        self._keep_logprobs(choice.get("logprobs"), len(text))
        items = self._items(text, calls, status)
        self._remember(text, calls)
        return orjson.dumps(self._response(status, items, chat.get("usage"), incomplete))

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
                out += self._text_delta(text, ch.get("logprobs"))
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    merge_tool_call(self._calls, tc)
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        return out

    def _text_delta(self, text: str, lp: Any) -> bytes:
        out = b""
        if not self._text_open:
            self._text_open = True
            out += self._ev("response.output_item.added", output_index=0, item={
                "type": "message", "id": self._msg_id, "status": "in_progress",
                "role": "assistant", "content": []})
            out += self._ev("response.content_part.added", item_id=self._msg_id,
                            output_index=0, content_index=0, part={
                                "type": "output_text", "text": "", "annotations": [],
                                "logprobs": []})
        self._text.append(text)
        self._text_chars += len(text)
        return out + self._ev("response.output_text.delta", item_id=self._msg_id,
                              output_index=0, content_index=0, delta=text,
                              logprobs=self._keep_logprobs(lp, self._text_chars))

    def done(self) -> bytes:
        out = b"" if self._seq else self.event({})
        text = "".join(self._text)
        calls = [self._calls[i] for i in sorted(self._calls)]
        status, incomplete = _STATUS.get(self._finish or "", ("completed", None))
        items = self._items(text, calls, status)
        index = 0
        if self._text_open:
            message = items[0]
            out += self._ev("response.output_text.done", item_id=self._msg_id,
                            output_index=0, content_index=0, text=text,
                            logprobs=self._logprobs)
            out += self._ev("response.content_part.done", item_id=self._msg_id,
                            output_index=0, content_index=0, part=message["content"][0])
            out += self._ev("response.output_item.done", output_index=0, item=message)
            index = 1
        for item in items:
            if item["type"] != "message":
                out += self._call_events(item, index)
                index += 1
        if not self._text_open and not calls:
            items = []
        self._remember(text, calls)
        final = self._response(status, items, self._usage, incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._ev(kind, response=final)

    def _call_events(self, item: dict[str, Any], index: int) -> bytes:
        """One tool call's events, whole (the engine's parser releases it at the end)."""
        custom = item["type"] == "custom_tool_call"
        field, prefix = ("input", "response.custom_tool_call_input") if custom \
            else ("arguments", "response.function_call_arguments")
        pending = {**item, field: "", "status": "in_progress"}
        return (self._ev("response.output_item.added", output_index=index, item=pending)
                + self._ev(f"{prefix}.delta", item_id=item["id"], output_index=index,
                           delta=item[field])
                + self._ev(f"{prefix}.done", item_id=item["id"], output_index=index,
                           **{field: item[field]})
                + self._ev("response.output_item.done", output_index=index, item=item))

    def error_body(self, exc: GatewayError) -> bytes:
        kind, code = _error_kind(exc)
        return openai_error_body(exc.message, error_type=kind, param=exc.param, code=code)

    def error_event(self, exc: GatewayError) -> bytes:
        _, code = _error_kind(exc)
        return self._ev("error", code=code, message=exc.message, param=exc.param)


def _error_kind(exc: GatewayError) -> tuple[str, str | None]:
    """The error ``type`` and ``code`` a Responses client expects: an engine's 4xx (a
    prompt past the context length, a bad parameter) is the request's fault, as at OpenAI,
    not a gateway failure."""
    if isinstance(exc, UpstreamError) and exc.status_code < 500:
        code = "context_length_exceeded" if "maximum context length" in exc.message else None
        return "invalid_request_error", code
    return exc.error_type, exc.code


def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if not u:
        return None
    inp, outp = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    return {"input_tokens": inp, "output_tokens": outp, "total_tokens": inp + outp,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
