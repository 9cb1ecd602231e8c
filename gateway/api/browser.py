"""What a web page in the operator's browser must not do to the gateway, even on loopback.

Two checks in front of every route (the raw completion path included):

- **Host** (DNS rebinding: a page's own domain re-pointed at 127.0.0.1 makes the browser
  talk to the gateway as that page's origin): a request whose ``Host`` is not one this
  gateway serves gets 400. Served: the bound address, ``localhost``/``127.0.0.1``/
  ``[::1]`` on loopback, and ``server.allowed_hosts``; a wildcard bind (``0.0.0.0``,
  ``::``) serves any host until ``allowed_hosts`` is set.
- **Origin** (cross-site requests: a ``text/plain`` POST needs no CORS preflight): a
  state-changing request (POST, PUT, PATCH, DELETE) whose ``Origin`` is neither the
  gateway's own (the ``Host`` it was sent to) nor one of ``server.cors_origins`` gets 403.
  Requests without ``Origin`` pass: browsers send it on every such request, other
  clients (SDKs, curl, the trainer) do not.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.errors import error_response
from gateway.config import ServerSettings, is_loopback
from gateway.errors import BadRequest, Forbidden

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def served_hosts(server: ServerSettings) -> list[str]:
    """The ``Host`` names (no port) this gateway answers; ``["*"]`` for any."""
    extra = [h.lower() for h in server.allowed_hosts]
    if "*" in extra or (server.host in WILDCARD_BINDS and not extra):
        return ["*"]
    bound = server.host.lower()
    own = [f"[{bound}]" if ":" in bound else bound]
    if is_loopback(server.host) or server.host in WILDCARD_BINDS:
        own += LOOPBACK_HOSTS
    return list(dict.fromkeys(own + extra))


def host_name(host_header: str) -> str:
    """``Host`` without its port, lower case (``[::1]:8000`` -> ``[::1]``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(p == "*" or name == p or (p.startswith("*.") and name.endswith(p[1:]))
               for p in patterns)


class BrowserGuard:
    """ASGI middleware: the Host and Origin checks of the module docstring."""

    def __init__(self, app: ASGIApp, server: ServerSettings) -> None:
        self.app = app
        self.hosts = served_hosts(server)
        self.any_host = self.hosts == ["*"]
        self.origins = {o.rstrip("/").lower() for o in server.cors_origins}
        self.any_origin = "*" in self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> Response | None:
        """The answer to a request these checks refuse; None when it may go on."""
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
        if not self.any_host and (host is None or not _matches(host_name(host), self.hosts)):
            return error_response(Request(scope), BadRequest(
                f"Host {host!r} is not served here (DNS rebinding guard); served: "
                f"{', '.join(self.hosts)}. Add it to ROLLOUT_GATEWAY_SERVER__ALLOWED_HOSTS"))
        if origin is None or scope["method"] in SAFE_METHODS or self._origin_ok(origin, host):
            return None
        return error_response(Request(scope), Forbidden(
            f"cross-origin {scope['method']} from {origin!r} refused: only this gateway's "
            "own pages and ROLLOUT_GATEWAY_SERVER__CORS_ORIGINS may change state"))

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        scheme, sep, netloc = origin.partition("://")
        return bool(sep) and scheme in ("http", "https") and host is not None \
            and netloc == host.strip().lower()
