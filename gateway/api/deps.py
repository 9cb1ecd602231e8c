"""Request-scoped access to the runtime, and the bearer checks."""

from __future__ import annotations

import hmac

from fastapi import Request

from gateway.errors import Unauthorized
from gateway.proxy.relay import Proxy
from gateway.runtime import Runtime


def get_rt(request: Request) -> Runtime:
    rt: Runtime = request.state.rt
    return rt


def get_proxy(request: Request) -> Proxy:
    proxy: Proxy = request.state.proxy
    return proxy


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison, so the token cannot be guessed byte by byte."""
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def is_admin(request: Request) -> bool:
    """True with the admin token (or when none is configured, which only loopback allows)."""
    expected = get_rt(request).settings.admin_token
    return expected is None or token_matches(_bearer(request), expected)


def require_admin(request: Request) -> None:
    if not is_admin(request):
        raise Unauthorized("admin endpoints need 'Authorization: Bearer <admin token>'")


async def require_api_key(request: Request) -> None:
    """When API keys are configured, every /v1 call must present one of them.

    ``async`` although it never awaits: FastAPI runs a plain ``def`` dependency in its
    thread pool, a thread hop on every proxied call."""
    keys = get_rt(request).settings.api_keys
    if not keys:
        return
    presented = _bearer(request) or request.headers.get("x-api-key")  # Anthropic clients
    if not any(token_matches(presented, k) for k in keys):
        raise Unauthorized("invalid or missing API key")
