"""How an error leaves the gateway: one handler map for the whole app, and the body limit.

``/v1/*`` routes answer in OpenAI's envelope ``{"error": {message, type, param, code}}``
(the Messages routes in Anthropic's), the Gemini API's in Google's
``{"error": {code, message, status}}``; every other route in FastAPI's ``{"detail": ...}``.
The choice is made by path in one place so a route cannot get it wrong. The exceptions
themselves are :mod:`gateway.errors`.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.envelopes import anthropic_error_body, google_error_body, openai_error_body
from gateway.errors import GatewayError, PayloadTooLarge


def _is_anthropic_path(request: Request) -> bool:
    """The Messages route and its sub-routes (``/v1/messages/count_tokens``, ...)."""
    path = request.url.path
    return path.endswith("/v1/messages") or "/v1/messages/" in path


def _is_gemini_path(request: Request) -> bool:
    """The Gemini API's routes (``/v1beta/...``, and ``/v1/models/{model}:method`` where the
    Python SDK asks), under any prefix."""
    path = request.url.path
    if "/v1beta/" in path or path.endswith("/v1beta"):
        return True
    at = path.find("/v1/models/")
    return at >= 0 and ":" in path[at + len("/v1/models/"):]


def _is_openai_path(request: Request) -> bool:
    return "/v1/" in request.url.path or request.url.path.endswith("/v1")


def error_response(request: Request, exc: GatewayError) -> Response:
    if _is_anthropic_path(request):
        body = anthropic_error_body(exc.status_code, exc.message)
    elif _is_gemini_path(request):
        body = google_error_body(exc.status_code, exc.message)
    elif _is_openai_path(request):
        body = openai_error_body(
            exc.message, error_type=exc.error_type, param=exc.param, code=exc.code
        )
    else:
        body = orjson.dumps({"detail": exc.message})
    return Response(
        body, status_code=exc.status_code, headers=exc.headers, media_type="application/json"
    )


def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    if _is_gemini_path(request):
        message = str(exc.detail) if exc.status_code != 404 else \
            f"{request.method} {request.url.path} is not served by this gateway"
        return Response(google_error_body(exc.status_code, message),
                        status_code=exc.status_code, media_type="application/json")
    if not _is_openai_path(request):
        detail: Any = exc.detail
        return Response(
            orjson.dumps({"detail": detail}),
            status_code=exc.status_code,
            headers=dict(exc.headers or {}),
            media_type="application/json",
        )
    if _is_anthropic_path(request):
        message = str(exc.detail) if exc.status_code != 404 else \
            f"{request.method} {request.url.path} is not served by this gateway"
        return Response(anthropic_error_body(exc.status_code, message),
                        status_code=exc.status_code, media_type="application/json")
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return Response(
        openai_error_body(str(exc.detail), error_type=kind),
        status_code=exc.status_code,
        media_type="application/json",
    )


def _json_safe(error: Any) -> Any:
    """A validation error as JSON can carry it: its echoed ``input`` may hold what JSON
    parsers accept but orjson cannot write back (integers past 64 bits)."""
    try:
        orjson.dumps(error, default=str)
    except TypeError:
        return {**error, "input": repr(error.get("input"))[:1000]}
    return error


def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    if not _is_openai_path(request) and not _is_gemini_path(request):
        return Response(
            orjson.dumps({"detail": [_json_safe(e) for e in exc.errors()]}, default=str),
            status_code=422,
            media_type="application/json",
        )
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if _is_anthropic_path(request):
        return Response(anthropic_error_body(400, f"{loc}: {first.get('msg', 'invalid')}"),
                        status_code=400, media_type="application/json")
    if _is_gemini_path(request):
        return Response(google_error_body(400, f"{loc}: {first.get('msg', 'invalid')}"),
                        status_code=400, media_type="application/json")
    return Response(
        openai_error_body(
            f"{loc}: {first.get('msg', 'invalid request')}",
            error_type="invalid_request_error",
            param=loc or None,
        ),
        status_code=400,
        media_type="application/json",
    )


class BodyLimit:
    """ASGI middleware: 413 for a declared ``Content-Length`` over ``limit`` before any of
    the body is read, and :class:`PayloadTooLarge` from ``receive`` once a body without
    one grows past it, so no route buffers an unbounded body."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            too_large = PayloadTooLarge(f"request body over {self.limit} bytes")
            await error_response(request, too_large)(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise PayloadTooLarge(f"request body over {self.limit} bytes")
            return message

        await self.app(scope, counting_receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """One handler map for the whole app."""

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return _http_exception(request, exc)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(request, exc)

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
