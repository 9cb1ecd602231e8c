"""Reading and checking request bodies before a call is tagged or queued (a 413 past the
size limit, a 400 naming the offending field), and the message of an engine's error body."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from gateway.envelopes import openai_error_body
from gateway.errors import BadRequest, PayloadTooLarge


def parse_door(raw: bytes) -> dict[str, Any]:
    """A front door's body: a JSON object with a model (the door checks the rest)."""
    body = _json_body(raw)
    _check_stream(body)
    return body


def _json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object naming a model, or a 400 that says what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return body


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


def parse_request(raw: bytes, *, chat: bool) -> dict[str, Any]:
    """The body as a dict, or a 400 that names the offending field."""
    body = _json_body(raw)
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
