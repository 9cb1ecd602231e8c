"""The Anthropic Messages API (``POST /v1/messages``) over a chat-completions engine.

What a request may hold, as the Anthropic SDK and Claude Code send it:

- ``system``: a string or text blocks. A block starting ``x-anthropic-billing-header:``
  is Claude Code's attribution line, read by Anthropic's own API, not prompt text: it is
  dropped (its content changes with the Claude Code version).
- ``messages``: ``user`` and ``assistant`` turns, and ``system`` turns anywhere (Claude
  Code sends its environment description as ``messages[1]``, after the first user turn,
  and later reminders the same way). A system turn stays a system message *where it
  is*: the conversation then only grows at its end, so each call's prompt extends the
  previous one, which the engine's prefix cache and the trace's prefix deltas rely on.
  Folding it into the leading system prompt would rewrite the head of every later
  prompt whenever a new one appeared. Qwen-family chat templates render a system turn
  at any position; an engine whose template refuses one answers 400, relayed in
  Anthropic's shape.
- blocks: ``text``; ``tool_use``; ``tool_result`` (a string, text blocks, or
  ``tool_reference`` blocks; ``is_error`` results count as tool failures for the
  policies); ``thinking`` / ``redacted_thinking`` are dropped. ``cache_control`` and
  ``citations`` are accepted and ignored (the engine's prefix cache needs no markers).
- ``tools``: client tools (``name`` / ``description`` / ``input_schema``). A tool with
  ``defer_loading: true`` (client-side tool search) stays out of the engine's tool list,
  which sits at the head of the prompt; a ``tool_reference`` to it in a tool result is
  rendered there as the tool's definition, so loading a tool also only appends to the
  prompt. ``tool_choice`` (``disable_parallel_tool_use`` included), ``max_tokens``,
  ``stop_sequences``, ``temperature`` / ``top_p`` / ``top_k``, ``stream``.
- accepted and ignored: ``thinking``, ``output_config``, ``context_management``,
  ``metadata``, ``service_tier``; the ``anthropic-beta`` header.

Server tools (web search, code execution, ...) and image or document blocks answer 400 in
Anthropic's error shape, naming what is missing.

Usage: ``input_tokens`` is the engine's prompt length, in ``message_start`` too: a
streamed call asks the engine for the prompt ids (``return_token_ids``), whose count
arrives on the first chunk, before any content; this door never relays them.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import orjson

from gateway.envelopes import anthropic_error_body
from gateway.errors import BadRequest, GatewayError
from gateway.proxy.doors import failed_results, sse
from gateway.proxy.doors.memory import ResponseMemory
from gateway.trajectories.tools import ToolOutcome

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
         "function_call": "tool_use", "abort": "end_turn"}
_BILLING = "x-anthropic-billing-header:"
_ROLES = ("user", "assistant", "system")


def _text(content: Any, where: str, tools: dict[str, dict[str, Any]] | None = None) -> str:
    """The text of a string or of text blocks (``tools``: where ``tool_reference`` blocks
    may appear, the definitions they name)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of blocks", param=where)
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text":
            out.append(str(block.get("text", "")))
        elif kind == "tool_reference" and tools is not None:
            out.append(_reference(block, tools, f"{where}[{j}]"))
        else:
            raise BadRequest(f"{where}[{j}]: block type {kind!r} is not supported here by "
                             "this gateway (text only)", param=where)
    return "".join(out)


def _reference(block: dict[str, Any], tools: dict[str, dict[str, Any]], where: str) -> str:
    """A loaded tool's definition, as the engine's tool list would show it."""
    name = block.get("tool_name")
    if name not in tools:
        raise BadRequest(f"{where}: tool_reference names {name!r}, which is not in 'tools'",
                         param="tools")
    return orjson.dumps(tools[name]).decode()


def _system(system: Any) -> str:
    if isinstance(system, list):
        system = [b for b in system if not (
            isinstance(b, dict) and str(b.get("text", "")).startswith(_BILLING))]
    return _text(system, "system")


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


@dataclasses.dataclass
class _Converted:
    messages: list[dict[str, Any]]
    errors: set[str]  # ids of tool results marked is_error


def _convert(messages: Any, memory: ResponseMemory, tools: dict[str, dict[str, Any]]
             ) -> _Converted:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    out = _Converted([], set())
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLES:
            raise BadRequest(f"{where}.role must be 'user', 'assistant' or 'system'",
                             param=where)
        content = m.get("content")
        if isinstance(content, str) or role == "system":
            out.messages.append({"role": role, "content": _text(content, f"{where}.content")})
        elif not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or an array of blocks",
                             param=where)
        else:
            _blocks(role, content, where, memory, tools, out)
    return out


def _blocks(role: str, content: list[Any], where: str, memory: ResponseMemory,
            tools: dict[str, dict[str, Any]], out: _Converted) -> None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name", ""), "arguments": _arguments(block, memory)}})
        elif kind == "tool_result" and role == "user":
            tid = str(block.get("tool_use_id"))
            if block.get("is_error") is True:
                out.errors.add(tid)
            body = block.get("content")
            out.messages.append({"role": "tool", "tool_call_id": tid, "content": "" if body
                                 is None else _text(body, f"{where}.content[{j}].content",
                                                    tools)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise BadRequest(f"{where}.content[{j}]: block type {kind!r} is not "
                             "supported by this gateway (text, tool_use, tool_result)",
                             param=where)
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            msg["tool_calls"] = calls
        out.messages.append(msg)
    elif texts:
        out.messages.append({"role": "user", "content": "".join(texts)})


def _tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The engine's tool list, and every tool's definition by name (deferred ones too)."""
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    listed, everyone = [], {}
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") \
                or "input_schema" not in t:
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise BadRequest(f"tools[{i}]: tool type {kind!r} is not supported by this "
                             "gateway (client tools with an input_schema only)", param="tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        entry = {"type": "function", "function": fn}
        everyone[str(t.get("name"))] = entry
        if t.get("defer_loading") is not True:
            listed.append(entry)
    return listed, everyone


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise BadRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        chat["parallel_tool_calls"] = False


def chat_messages(body: dict[str, Any], memory: ResponseMemory
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[str]]:
    """A Messages request's conversation as chat messages, its tools as the engine's tool
    list, and the ids of ``is_error`` tool results (``/v1/messages`` and, for a
    ``count_tokens`` route, the same prompt)."""
    listed, everyone = _tools(body["tools"]) if body.get("tools") else ([], {})
    conv = _convert(body.get("messages"), memory, everyone)
    messages = conv.messages
    system = _system(body["system"]) if body.get("system") else ""
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    return messages, listed, conv.errors


class MessagesCall:
    def __init__(self, body: dict[str, Any], memory: ResponseMemory) -> None:
        self.request = body
        self.memory = memory
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        if not isinstance(body.get("max_tokens"), int) or isinstance(body["max_tokens"], bool) \
                or body["max_tokens"] < 1:
            raise BadRequest("'max_tokens' is required and must be a positive integer",
                             param="max_tokens")
        messages, tools, self.error_ids = chat_messages(body, memory)
        chat: dict[str, Any] = {"model": body["model"], "messages": messages,
                                "max_tokens": body["max_tokens"]}
        if tools:
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            _tool_choice(body["tool_choice"], chat)
        if body.get("stop_sequences"):
            chat["stop"] = body["stop_sequences"]
        for key in ("temperature", "top_p", "top_k"):
            if key in body:
                chat[key] = body[key]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
            chat["return_token_ids"] = True  # the prompt's length for message_start
        self.chat_body = chat
        self._started = False
        self._block = -1  # index of the open content block
        self._open: str | None = None  # "text" or "tool"
        self._tool_index: dict[int, int] = {}  # chat tool-call index -> block index
        self._tool_ids: dict[int, str] = {}
        self._tool_args: dict[int, list[str]] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}
        self._input_tokens = 0

    def adjust_outcomes(self, outcomes: list[ToolOutcome]) -> list[ToolOutcome]:
        """``is_error`` tool results are failures whatever their text says."""
        return failed_results(outcomes, self.chat_body, self.error_ids)

    def _message(self, content: list[dict[str, Any]], stop: str | None,
                 input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.request["model"], "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

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
        usage = chat.get("usage") or {}
        return orjson.dumps(self._message(content, stop, _count(usage, "prompt_tokens"),
                                          _count(usage, "completion_tokens")))

    # ------------------------------------------------------------------ stream
    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self._block})

    def _start(self, chunk: dict[str, Any]) -> bytes:
        """``message_start``, on the engine's first chunk: the one with the prompt ids."""
        self._started = True
        prompt = chunk.get("prompt_token_ids")
        if isinstance(prompt, list):
            self._input_tokens = len(prompt)
        elif isinstance(chunk.get("usage"), dict):
            self._input_tokens = _count(chunk["usage"], "prompt_tokens")
        return sse("message_start", {"type": "message_start", "message": self._message(
            [], None, self._input_tokens, 0)})

    def event(self, chunk: dict[str, Any]) -> bytes:
        out = self._start(chunk) if not self._started else b""
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta") or {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._text_delta(text)
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    out += self._tool_delta(tc)
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        return out

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._open != "text":
            out += self._close()
            self._block += 1
            self._open = "text"
            out += sse("content_block_start", {
                "type": "content_block_start", "index": self._block,
                "content_block": {"type": "text", "text": ""}})
        return out + sse("content_block_delta", {
            "type": "content_block_delta", "index": self._block,
            "delta": {"type": "text_delta", "text": text}})

    def _tool_delta(self, tc: dict[str, Any]) -> bytes:
        out = b""
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
        return out

    def done(self) -> bytes:
        out = b"" if self._started else self.event({})
        out += self._close()
        for idx, tool_id in self._tool_ids.items():
            self.memory.put_arguments(tool_id, "".join(self._tool_args.get(idx, [])))
        stop = _STOP.get(self._finish or "stop", "end_turn")
        out += sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"input_tokens": _count(self._usage, "prompt_tokens")
                      or self._input_tokens,
                      "output_tokens": _count(self._usage, "completion_tokens")}})
        return out + sse("message_stop", {"type": "message_stop"})

    def error_body(self, exc: GatewayError) -> bytes:
        return anthropic_error_body(exc.status_code, exc.message)

    def error_event(self, exc: GatewayError) -> bytes:
        return sse("error", orjson.loads(anthropic_error_body(exc.status_code, exc.message)))


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _json(raw: Any) -> Any:
    if not isinstance(raw, str) or not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"_raw": raw}
