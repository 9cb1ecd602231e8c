"""The error envelopes the gateway writes: OpenAI's ``{"error": {message, type, param,
code}}``, Anthropic's ``{"type": "error", "error": {type, message}}`` and Google's
``{"error": {code, message, status}}`` (the Gemini API's).

Below both the API layer (whose handlers pick one by path, :mod:`gateway.api.errors`) and
the proxy (which writes them into a stream already under way, or in place of an engine's
own error body).
"""

from __future__ import annotations

import orjson


def openai_error_body(
    message: str, *, error_type: str, param: str | None = None, code: str | int | None = None
) -> bytes:
    """OpenAI's error envelope, serialized."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    )


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error envelope (what its SDK parses), serialized."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                  404: "NOT_FOUND", 409: "ABORTED", 413: "INVALID_ARGUMENT",
                  429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 501: "UNIMPLEMENTED",
                  502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def google_error_body(status: int, message: str) -> bytes:
    """Google's error envelope (what the Gemini SDKs and Gemini CLI parse), serialized:
    ``code`` is the HTTP status, ``status`` its canonical gRPC name."""
    kind = _GOOGLE_STATUS.get(status, "INTERNAL")
    return orjson.dumps({"error": {"code": status, "message": message, "status": kind}})
