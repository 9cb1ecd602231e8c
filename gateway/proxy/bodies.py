"""Reading and checking request bodies before a call is tagged or queued (a 413 past the
size limit, a 400 naming the offending field or the limit it exceeds), and the message of
an engine's error body.

What passes here is what the record of the call can hold: no nesting deeper than the
trace writer's encoder takes (``max_json_depth``) and no model name longer than its
column, so a call the gateway answers is never one it cannot store.
"""

from __future__ import annotations

from typing import Any

import orjson
from sqlalchemy import String
from starlette.requests import Request

from gateway.envelopes import openai_error_body
from gateway.errors import BadRequest, PayloadTooLarge
from gateway.store.models import Call


def stored_chars(column: str) -> int:
    """The length of the ``calls`` table's string column ``column``: what a call's record
    can hold of it (Postgres refuses the whole batch for one value that is longer)."""
    kind = Call.__table__.c[column].type
    if not isinstance(kind, String) or kind.length is None:
        raise TypeError(f"calls.{column} is not a string column of bounded length")
    return kind.length


#: the longest model name a call's record holds
MAX_MODEL_CHARS = stored_chars("model")
_NESTS = frozenset((dict, list))


def parse_door(raw: bytes, *, max_depth: int) -> dict[str, Any]:
    """A front door's body: a JSON object with a model (the door checks the rest)."""
    body = _json_body(raw, max_depth)
    _check_stream(body)
    return body


def _json_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object naming a model, or a 400 that says what is wrong."""
    body = json_object(raw, max_depth)
    check_model(body.get("model"), "'model'")
    return body


def json_object(raw: bytes, max_depth: int, *, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object nested at most ``max_depth`` deep, or a 400 saying what
    is wrong (``empty_ok``: an empty body is ``{}``)."""
    try:
        body = orjson.loads(raw) if raw.strip() or not empty_ok else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if json_depth(body, stop_after=max_depth) > max_depth:
        raise BadRequest(f"request body nests objects and arrays deeper than {max_depth} "
                         "levels (ROLLOUT_GATEWAY_SERVER__MAX_JSON_DEPTH)")
    return body


def check_model(model: Any, what: str) -> str:
    """``model`` if it is a name a call's record can hold, else a 400 (param ``model``)."""
    if not isinstance(model, str) or not model:
        raise BadRequest(f"{what} is required and must be a non-empty string", param="model")
    if len(model) > MAX_MODEL_CHARS:
        raise BadRequest(f"{what} is longer than {MAX_MODEL_CHARS} characters",
                         param="model")
    return model


def json_depth(value: Any, *, stop_after: int) -> int:
    """How deep objects and arrays nest in ``value`` as ``orjson.loads`` makes it (a
    scalar is 0, ``{}`` is 1), counted one level at a time without recursion; past
    ``stop_after`` it stops and answers ``stop_after + 1``, so a hostile body costs no
    more than an allowed one (about 2 ms for 2,000 messages, less than parsing them)."""
    level = [value] if type(value) in _NESTS else []
    depth = 0
    while level and depth <= stop_after:
        depth += 1
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            below.extend([c for c in children if type(c) in _NESTS])
        level = below
    return depth


def _check_stream(body: dict[str, Any]) -> None:
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise BadRequest("'stream' must be a boolean", param="stream")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body over {limit} bytes")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def parse_request(raw: bytes, *, chat: bool, max_depth: int) -> dict[str, Any]:
    """The body as a dict, or a 400 that names the offending field."""
    body = _json_body(raw, max_depth)
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("'messages' must be a non-empty array of objects", param="messages")
    elif not isinstance(body.get("prompt"), str | list):
        raise BadRequest("'prompt' is required (string or array)", param="prompt")
    _check_stream(body)
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise BadRequest("'n' must be a positive integer", param="n")
    return body


def upstream_message(data: bytes) -> str | None:
    """The message of an engine's error body (OpenAI's or vLLM's shape), if any."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return None


def openai_4xx_body(data: bytes, status: int) -> bytes:
    """An engine's 4xx answer in OpenAI's error envelope, its message kept: vLLM answers
    ``{"error": {"type": "BadRequestError", "code": 400, ...}}`` where OpenAI clients and
    harnesses look for ``invalid_request_error`` and ``context_length_exceeded``."""
    message = upstream_message(data) or data[:300].decode(errors="replace")
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    code = "context_length_exceeded" if "maximum context length" in message else None
    kind = {404: "not_found_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    return openai_error_body(message, error_type=kind,
                             param=param if isinstance(param, str) else None, code=code)
