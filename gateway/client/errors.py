"""What the trainer-side client raises, mapped from the gateway's two error shapes.

::

    GatewayClientError
    +-- GatewayConnectionError        the gateway could not be reached (connect, read, ...)
    +-- WaitTimeout                   a wait ran out (also a ``TimeoutError``)
    +-- JobFailed                     a pool job ended ``failed`` or ``cancelled``
    +-- GatewayHTTPError              the gateway answered with an error status
        +-- BadRequestError           400, 422 (validation)
        +-- AuthenticationError       401, 403 (token missing, wrong, or of another role)
        +-- NotFoundError             404
        +-- ConflictError             409 (e.g. no managed pool)
        +-- OverloadedError           429, 503 (``retry_after_s`` from ``Retry-After``)
        |   +-- PausedError           429 while the pool is paused for weight sync
        +-- UpstreamError             502, 504 (a backend failed or timed out)

The gateway answers ``/v1/*`` in OpenAI's envelope ``{"error": {message, type, param,
code}}`` and every other route as ``{"detail": ...}`` (see ``gateway/api/errors.py``); both are
read here, so ``message`` is always the gateway's own words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from gateway.client.types import JobInfo


class GatewayClientError(Exception):
    """Base of everything the client raises."""


class GatewayConnectionError(GatewayClientError):
    """The request did not get an HTTP answer (refused, reset, timed out)."""


class WaitTimeout(GatewayClientError, TimeoutError):
    """A wait gave up; ``finished`` holds what had finished by then (ids or infos)."""

    def __init__(self, message: str, *, finished: list[Any] | None = None) -> None:
        super().__init__(message)
        self.finished: list[Any] = finished or []


class JobFailed(GatewayClientError):
    """An admin job (pool resize, backend removal, weight update) ended without
    succeeding. ``job`` is the :class:`~gateway.client.types.JobInfo` of the finished job
    (``job.errors``, ``job.raw["phases"]``); ``job["errors"]`` still works for code
    written when it was the job's JSON."""

    def __init__(self, message: str, *, job: JobInfo | Mapping[str, Any]) -> None:
        from gateway.client.types import JobInfo

        super().__init__(message)
        self.job = job if isinstance(job, JobInfo) else JobInfo.from_json(dict(job))


class GatewayHTTPError(GatewayClientError):
    """An error answer. ``detail`` is the decoded body (``None`` if it was not JSON)."""

    def __init__(self, message: str, *, status_code: int, method: str, url: str,
                 code: str | None = None, detail: Any = None) -> None:
        super().__init__(f"{method} {url} -> {status_code}: {message}")
        self.message = message
        self.status_code = status_code
        self.code = code
        self.detail = detail


class BadRequestError(GatewayHTTPError):
    pass


class AuthenticationError(GatewayHTTPError):
    pass


class NotFoundError(GatewayHTTPError):
    pass


class ConflictError(GatewayHTTPError):
    pass


class OverloadedError(GatewayHTTPError):
    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class PausedError(OverloadedError):
    pass


class UpstreamError(GatewayHTTPError):
    pass


_BY_STATUS: dict[int, type[GatewayHTTPError]] = {
    400: BadRequestError, 422: BadRequestError, 401: AuthenticationError,
    403: AuthenticationError, 404: NotFoundError, 409: ConflictError,
    429: OverloadedError, 503: OverloadedError, 502: UpstreamError, 504: UpstreamError,
}


def _message(body: Any, fallback: str) -> tuple[str, str | None]:
    """(message, code) from either wire shape."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            code = err.get("code")
            return str(err.get("message") or fallback), None if code is None else str(code)
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail, None
        if isinstance(detail, list):  # FastAPI validation errors: [{loc, msg, ...}]
            parts = [f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d.get('msg')}"
                     for d in detail if isinstance(d, dict)]
            return "; ".join(parts) or fallback, None
    return fallback, None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def error_from_response(response: httpx.Response) -> GatewayHTTPError:
    """The exception for an error answer (status >= 400)."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    message, code = _message(body, response.text[:500] or response.reason_phrase)
    kw: dict[str, Any] = {"status_code": response.status_code,
                          "method": response.request.method, "url": str(response.request.url),
                          "code": code, "detail": body}
    cls = _BY_STATUS.get(response.status_code, GatewayHTTPError)
    if issubclass(cls, OverloadedError):
        paused = code == "paused_for_weight_sync" or "paused" in message.lower()
        cls = PausedError if paused and response.status_code == 429 else cls
        return cls(message, retry_after_s=_retry_after(response), **kw)
    return cls(message, **kw)


def raise_for_response(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise error_from_response(response)
