"""A Gemini API request (``generateContent``, ``countTokens``) as a chat-completions body.

What a request may hold, as the google-genai SDKs and Gemini CLI send it (camelCase or
the snake_case spelling Google's REST API also accepts):

- ``contents``: ``user`` and ``model`` turns (``function`` taken as ``user``), parts
  ``text``, ``functionCall`` (``name``, ``args``, optional ``id``) and
  ``functionResponse`` (``name``, ``response``, optional ``id``). ``thought`` parts and
  ``thoughtSignature`` are dropped (the engine's chat template has no slot for Gemini's
  thoughts). Consecutive ``model`` turns are one assistant message (an SDK that records
  each streamed chunk as its own turn re-sends one generated turn as several), its texts
  joined as generated; a user turn's text parts are joined with newlines.
- Tool call ids: Gemini's calls carry none, or an ``id`` in newer versions. A call
  without one gets ``call_{turn}_{part}`` (its position in ``contents``, so re-sending
  the same history gives the same ids); a ``functionResponse`` answers the call of the
  turn before with its ``id``, else the first unanswered one of its ``name``, else the
  first unanswered one. A response whose ``response`` has an ``error`` key counts as a
  tool failure for the policies; ``{"output": text}`` is sent to the model as the text.
- ``systemInstruction``; ``tools[].functionDeclarations[]`` (``parametersJsonSchema``
  as is, ``parameters`` in Gemini's schema with its upper-case types lowered); Google's
  hosted tools (``googleSearch``, ``codeExecution``, ``urlContext``, ...) are dropped,
  as the Responses door drops OpenAI's; ``toolConfig.functionCallingConfig`` (``AUTO``,
  ``ANY`` with ``allowedFunctionNames``, ``NONE``, ``VALIDATED`` as auto).
- ``generationConfig``: ``temperature``, ``topP``, ``topK``, ``maxOutputTokens``,
  ``stopSequences``, ``candidateCount`` (``n``), ``seed``, presence and frequency
  penalties, ``responseMimeType: application/json`` (with ``responseJsonSchema`` or
  ``responseSchema``) as ``response_format``; ``thinkingConfig``, ``safetySettings``
  and the logprob fields are accepted and ignored.

Images, files, code execution results and cached contents answer 400 naming the part.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import orjson

from gateway.errors import BadRequest
from gateway.proxy.bodies import check_model, json_object
from gateway.proxy.doors.memory import ResponseMemory

_UNSUPPORTED_PARTS = ("inlineData", "fileData", "executableCode", "codeExecutionResult")
_HOSTED = frozenset(("googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext",
                     "googleMaps", "fileSearch", "enterpriseWebSearch"))
_TYPES = frozenset(("STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"))
_MODES = {"AUTO": "auto", "VALIDATED": "auto", "MODE_UNSPECIFIED": "auto", "ANY": "required",
          "NONE": "none"}
_SAMPLING = (("temperature", "temperature"), ("topP", "top_p"), ("topK", "top_k"),
             ("seed", "seed"), ("presencePenalty", "presence_penalty"),
             ("frequencyPenalty", "frequency_penalty"))
_COUNTS = (("maxOutputTokens", "max_tokens"), ("candidateCount", "n"))
_CAMEL = re.compile(r"([A-Z])")


def field(obj: Any, camel: str) -> Any:
    """``obj[camel]``, or its snake_case spelling, or None."""
    if not isinstance(obj, dict):
        return None
    if camel in obj:
        return obj[camel]
    return obj.get(_CAMEL.sub(r"_\1", camel).lower())


def parse_gemini(raw: bytes, model: str | None, *, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object, with the model of the path (``models/{model}``) put in
    as ``model``."""
    body = json_object(raw, max_depth, empty_ok=True)
    body["model"] = check_model(model, "the model of the path (/v1beta/models/{model}:...)")
    return body


def _arguments_object(raw: Any) -> dict[str, Any]:
    """Tool-call arguments as Gemini's ``args`` (an object): the engine's JSON string
    parsed, or ``{"_raw": text}`` when it is not an object."""
    if isinstance(raw, str) and raw:
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return {"_raw": raw}
        return value if isinstance(value, dict) else {"_raw": raw}
    return {}


def arguments_key(name: str, args: Any) -> str:
    """Where :class:`ResponseMemory` keeps a call's raw arguments when it has no id."""
    return "gemini:" + name + ":" + orjson.dumps(args, option=orjson.OPT_SORT_KEYS).decode()


def remember_arguments(memory: ResponseMemory, call_id: str, name: str, raw: str
                       ) -> dict[str, Any]:
    """Keep the argument string the engine generated (by id, and by name and value: Gemini
    CLI renames ids); the ``args`` object a client gets."""
    args = _arguments_object(raw)
    memory.put_arguments(call_id, raw)
    memory.put_arguments(arguments_key(name, args), raw)
    return args


def _raw_arguments(call: dict[str, Any], memory: ResponseMemory) -> str:
    """The call's arguments as the engine wrote them when ``args`` is still that object;
    else ``args`` serialized."""
    name, args = str(call.get("name", "")), call.get("args") or {}
    for key in (call.get("id"), arguments_key(name, args)):
        raw = memory.arguments(key) if isinstance(key, str) else None
        if raw is not None and _arguments_object(raw) == args:
            return raw
    return orjson.dumps(args).decode()


def _response_text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, dict) and set(response) == {"output"} \
            and isinstance(response["output"], str):
        return response["output"]
    return orjson.dumps(response).decode()


@dataclasses.dataclass
class Conversation:
    messages: list[dict[str, Any]]
    errors: set[str]  # tool_call_ids of functionResponses that report an error


class _Turns:
    """``contents`` to chat messages, one turn at a time (see the module docstring)."""

    def __init__(self, memory: ResponseMemory) -> None:
        self.memory = memory
        self.out = Conversation([], set())
        self.pending: list[tuple[str, str]] = []  # (id, name) of unanswered calls

    def model(self, i: int, parts: list[Any]) -> None:
        last = self.out.messages[-1] if self.out.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            self.out.messages.append(last)
            self.pending = []
        for j, part in enumerate(parts):
            kind = _kind(part, f"contents[{i}].parts[{j}]")
            if kind == "text":
                last["content"] = (last["content"] or "") + part["text"]
            elif kind == "functionCall":
                call = field(part, "functionCall")
                call_id = call.get("id") or f"call_{i}_{j}"
                name = str(call.get("name", ""))
                last.setdefault("tool_calls", []).append({
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _raw_arguments(call, self.memory)}})
                self.pending.append((call_id, name))
            elif kind == "functionResponse":
                raise BadRequest(f"contents[{i}].parts[{j}]: a functionResponse belongs in "
                                 "a user turn", param="contents")
        if last["content"] is None and not last.get("tool_calls"):
            self.out.messages.pop()  # thoughts only

    def user(self, i: int, parts: list[Any]) -> None:
        texts = []
        for j, part in enumerate(parts):
            kind = _kind(part, f"contents[{i}].parts[{j}]")
            if kind == "text":
                texts.append(part["text"])
            elif kind == "functionResponse":
                answer = field(part, "functionResponse")
                tid = self._pair(answer, f"call_{i}_{j}")
                response = answer.get("response")
                if isinstance(response, dict) and "error" in response:
                    self.out.errors.add(tid)
                self.out.messages.append({"role": "tool", "tool_call_id": tid,
                                          "content": _response_text(response)})
            elif kind == "functionCall":
                raise BadRequest(f"contents[{i}].parts[{j}]: a functionCall belongs in a "
                                 "model turn", param="contents")
        if texts:
            self.out.messages.append({"role": "user", "content": "\n".join(texts)})

    def _pair(self, answer: dict[str, Any], fallback: str) -> str:
        """The id of the call a functionResponse answers."""
        rid, name = answer.get("id"), answer.get("name")
        for pick in ([c for c in self.pending if c[0] == rid],
                     [c for c in self.pending if c[1] == name], self.pending):
            if pick:
                self.pending.remove(pick[0])
                return pick[0][0]
        return rid if isinstance(rid, str) and rid else fallback


def _kind(part: Any, where: str) -> str | None:
    """``text``, ``functionCall``, ``functionResponse``, or None (a part dropped)."""
    if not isinstance(part, dict):
        raise BadRequest(f"{where} must be an object", param="contents")
    if part.get("thought") is True:
        return None
    for key in _UNSUPPORTED_PARTS:
        if field(part, key) is not None:
            raise BadRequest(f"{where}: {key} parts are not supported by this gateway "
                             "(text, functionCall and functionResponse only)", param="contents")
    if "text" in part:
        if not isinstance(part["text"], str):
            raise BadRequest(f"{where}.text must be a string", param="contents")
        return "text"
    for key in ("functionCall", "functionResponse"):
        value = field(part, key)
        if value is not None:
            if not isinstance(value, dict):
                raise BadRequest(f"{where}.{key} must be an object", param="contents")
            return key
    if set(part) <= {"thoughtSignature", "thought_signature", "thought", "partMetadata"}:
        return None
    raise BadRequest(f"{where} has none of text, functionCall, functionResponse",
                     param="contents")


def conversation(body: dict[str, Any], memory: ResponseMemory) -> Conversation:
    """``systemInstruction`` and ``contents`` as chat messages."""
    contents = body.get("contents")
    if isinstance(contents, dict):  # one Content instead of a list: the API takes it
        contents = [contents]
    if not isinstance(contents, list) or not contents:
        raise BadRequest("'contents' must be a non-empty array", param="contents")
    turns = _Turns(memory)
    system = _system(field(body, "systemInstruction"))
    if system:
        turns.out.messages.append({"role": "system", "content": system})
    for i, content in enumerate(contents):
        role = content.get("role") or "user" if isinstance(content, dict) else None
        parts = content.get("parts") if isinstance(content, dict) else None
        if role not in ("user", "model", "function") or not isinstance(parts, list):
            raise BadRequest(f"contents[{i}] must be an object with role 'user' or 'model' "
                             "and a 'parts' array", param="contents")
        if role == "model":
            turns.model(i, parts)
        else:
            turns.user(i, parts)
    return turns.out


def _system(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    parts = system.get("parts") if isinstance(system, dict) else None
    if not isinstance(parts, list):
        raise BadRequest("'systemInstruction' must be a Content with text parts",
                         param="systemInstruction")
    texts = []
    for j, part in enumerate(parts):
        kind = _kind(part, f"systemInstruction.parts[{j}]")
        if kind == "text":
            texts.append(part["text"])
        elif kind is not None:
            raise BadRequest(f"systemInstruction.parts[{j}]: text only",
                             param="systemInstruction")
    return "\n".join(texts)


def _schema(value: Any) -> Any:
    """Gemini's OpenAPI-style schema as JSON Schema: ``"type": "OBJECT"`` -> ``"object"``."""
    if isinstance(value, list):
        return [_schema(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _schema(v) for k, v in value.items()}
    kind = out.get("type")
    if isinstance(kind, str) and kind.upper() in _TYPES:
        out["type"] = kind.lower()
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools[].functionDeclarations[]`` as the engine's function tools."""
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise BadRequest(f"tools[{i}] must be an object", param="tools")
        for key, value in tool.items():
            camel = re.sub(r"_([a-z])", lambda m: m.group(1).upper(), key)
            if camel == "functionDeclarations" and isinstance(value, list):
                out.extend(_function(d, f"tools[{i}].{key}[{k}]") for k, d in enumerate(value))
            elif camel not in _HOSTED:
                raise BadRequest(f"tools[{i}].{key} is not supported by this gateway "
                                 "(functionDeclarations; hosted tools are dropped)",
                                 param="tools")
    return out


def _function(decl: Any, where: str) -> dict[str, Any]:
    name = decl.get("name") if isinstance(decl, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name is required", param="tools")
    params = field(decl, "parametersJsonSchema")
    if params is None:
        params = _schema(field(decl, "parameters"))
    fn: dict[str, Any] = {"name": name,
                          "parameters": params or {"type": "object", "properties": {}}}
    if decl.get("description"):
        fn["description"] = decl["description"]
    return {"type": "function", "function": fn}


def tool_choice(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """``toolConfig.functionCallingConfig`` as ``tool_choice`` (only with tools)."""
    config = field(field(body, "toolConfig"), "functionCallingConfig")
    if config is None or not chat.get("tools"):
        return
    mode = str(config.get("mode", "AUTO")).upper() if isinstance(config, dict) else None
    if mode not in _MODES:
        raise BadRequest(f"functionCallingConfig.mode {mode!r} is not supported",
                         param="toolConfig")
    chat["tool_choice"] = _MODES[mode]
    names = field(config, "allowedFunctionNames")
    if mode == "ANY" and isinstance(names, list) and names:
        chat["tools"] = [t for t in chat["tools"] if t["function"]["name"] in names]
        if len(names) == 1:
            chat["tool_choice"] = {"type": "function", "function": {"name": names[0]}}


def generation(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """``generationConfig`` onto the chat body."""
    config = field(body, "generationConfig")
    if config is None:
        return
    if not isinstance(config, dict):
        raise BadRequest("'generationConfig' must be an object", param="generationConfig")
    for gemini, key in _SAMPLING:
        if field(config, gemini) is not None:
            chat[key] = field(config, gemini)
    for gemini, key in _COUNTS:
        value = field(config, gemini)
        if value is not None:
            if type(value) is not int or value < 1:
                raise BadRequest(f"generationConfig.{gemini} must be a positive integer",
                                 param="generationConfig")
            chat[key] = value
    stop = field(config, "stopSequences")
    if stop:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("generationConfig.stopSequences must be an array of strings",
                             param="generationConfig")
        chat["stop"] = stop
    _response_format(config, chat)


def _response_format(config: dict[str, Any], chat: dict[str, Any]) -> None:
    mime = field(config, "responseMimeType")
    if mime in (None, "", "text/plain"):
        return
    if mime != "application/json":
        raise BadRequest(f"responseMimeType {mime!r} is not supported by this gateway "
                         "(text/plain, application/json)", param="generationConfig")
    schema = field(config, "responseJsonSchema")
    if schema is None and field(config, "responseSchema") is not None:
        schema = _schema(field(config, "responseSchema"))
    chat["response_format"] = {"type": "json_object"} if schema is None else {
        "type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def chat_prompt(body: dict[str, Any], memory: ResponseMemory
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[str]]:
    """A request's conversation as chat messages, its tools as the engine's tool list, and
    the ids of tool results that report an error (``generateContent`` and, for
    ``countTokens``, the same prompt)."""
    if field(body, "cachedContent"):
        raise BadRequest("cachedContent is not supported by this gateway: send the contents",
                         param="cachedContent")
    tools = chat_tools(body["tools"]) if body.get("tools") else []
    conv = conversation(body, memory)
    return conv.messages, tools, conv.errors
