"""The gateway's exception hierarchy and its two wire shapes.

::

    GatewayError                      (500 internal_error)
    +-- BadRequest                    (400 invalid_request_error)
    |   +-- InvalidTrajectoryId       (400, param "trajectory_id")
    +-- Unauthorized                  (401 authentication_error)
    +-- Forbidden                     (403 permission_error: a valid credential, wrong role)
    +-- NotFound                      (404 not_found_error)
    |   +-- ModelNotFound             (404 model_not_found)
    +-- Conflict                      (409: the request clashes with the current state)
    +-- PayloadTooLarge               (413)
    +-- Overloaded                    (429 / 503 with Retry-After)
    |   +-- Paused                    (429 while the pool is paused for weight sync)
    +-- UpstreamError                 (502 bad_gateway: a backend failed)
    |   +-- UpstreamTimeout           (504 gateway_timeout)
    +-- NoBackendAvailable            (503 service_unavailable)
    +-- StoreUnavailable              (503 with Retry-After: a trajectory's state could not
                                       be read from the store; the call was not run)

``/v1/*`` routes answer in OpenAI's envelope ``{"error": {message, type, param, code}}``;
every other route in FastAPI's ``{"detail": ...}``. The choice is made by path in one
handler so a route cannot get it wrong.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class GatewayError(Exception):
    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class InvalidTrajectoryId(BadRequest):
    code = "invalid_trajectory_id"


class Unauthorized(GatewayError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status_code = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    error_type = "invalid_request_error"
    code = "model_not_found"


class Conflict(GatewayError):
    status_code = 409
    error_type = "conflict_error"
    code = "conflict"


class TrajectoryFinished(Conflict):
    """A queued call whose trajectory attempt was finished before it could be placed."""

    code = "trajectory_finished"


class SchedulingFailed(GatewayError):
    """The scheduler raised while placing this call; the call fails, the pool goes on."""

    status_code = 500
    error_type = "server_error"
    code = "scheduling_failed"


class PayloadTooLarge(GatewayError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class Overloaded(GatewayError):
    status_code = 503
    error_type = "overloaded_error"
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, status: int = 503) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})
        self.status_code = status


class Paused(Overloaded):
    code = "paused_for_weight_sync"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s, status=429)


class UpstreamError(GatewayError):
    status_code = 502
    error_type = "bad_gateway"
    code = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "gateway_timeout"
    code = "upstream_timeout"


class NoBackendAvailable(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_backend"


class StoreUnavailable(GatewayError):
    """The store could not say in time what it holds of a trajectory the gateway does not
    (after a restart): the call is refused rather than run on a guess."""

    status_code = 503
    error_type = "service_unavailable"
    code = "store_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})


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


def _is_anthropic_path(request: Request) -> bool:
    """The Messages route and its sub-routes (``/v1/messages/count_tokens``, ...)."""
    path = request.url.path
    return path.endswith("/v1/messages") or "/v1/messages/" in path


def _is_openai_path(request: Request) -> bool:
    return "/v1/" in request.url.path or request.url.path.endswith("/v1")


def error_response(request: Request, exc: GatewayError) -> Response:
    if _is_anthropic_path(request):
        body = anthropic_error_body(exc.status_code, exc.message)
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
    if not _is_openai_path(request):
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
