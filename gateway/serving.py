"""How the gateway is served: uvicorn's settings, and the limits uvicorn lacks.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but has no deadline
for receiving a request: its keep-alive timer is cancelled by the first byte, so a client
that sends one byte a second holds a connection (and a file descriptor) for as long as it
likes (uvicorn issue #157 lists the missing ``--timeout-request-start`` and
``--timeout-request-complete``). Nor can it cap the connections of one client:
``limit_concurrency`` counts everyone's together. :class:`GuardedHttpProtocol` adds both
to uvicorn's own httptools protocol (uvicorn's default; ``uvicorn[standard]`` installs
httptools), through the protocol class uvicorn accepts as ``http=``:

- a request's line and headers must arrive within ``server.header_timeout_s`` of its first
  byte (or of the connection's opening), its body within ``server.body_timeout_s`` of its
  headers; else the client gets 408 and the connection is closed (or, when an answer has
  already begun, only closed). Once a request has fully arrived no deadline applies: a
  long generation streams for as long as it takes;
- a client IP holds at most ``server.max_connections_per_client`` connections; one more
  is answered 429 and closed.

It reads a few attributes of uvicorn's request cycle (``cycle``, ``more_body``,
``response_started``, ``response_complete``, ``disconnected``), present in uvicorn's
protocols for years; tests/gateway/test_security.py exercises each path on real sockets.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, ClassVar, Literal

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import ServerSettings, Settings

Stage = Literal["head", "body", "done"]


class ConnectionLimits:
    """The limits one server applies, and its count of connections per client IP."""

    def __init__(self, server: ServerSettings) -> None:
        self.header_timeout_s = server.header_timeout_s
        self.body_timeout_s = server.body_timeout_s
        self.per_client = server.max_connections_per_client
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.timed_out = 0

    def admit(self, client: str) -> bool:
        if self.per_client and self.open[client] >= self.per_client:
            self.refused += 1
            return False
        self.open[client] += 1
        return True

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]


def _plain(status: bytes, message: str, extra: bytes = b"") -> bytes:
    body = message.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\n" + extra + b"content-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


#: Set in a request's ASGI scope by a route that answers for as long as its client listens
#: (the status page's event stream). uvicorn's graceful shutdown waits for every response
#: in progress and, after ``shutdown_grace_s``, cancels them with a traceback per request;
#: a request marked so is told at once that its client has gone, and its stream ends.
ENDS_AT_SHUTDOWN = "rollout_gateway.ends_at_shutdown"


class StreamsEndAtShutdown(HttpToolsProtocol):
    """uvicorn's httptools protocol that ends the requests marked :data:`ENDS_AT_SHUTDOWN`
    when the server begins to shut down (model calls in flight still finish)."""

    def shutdown(self) -> None:
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete
                and cycle.scope.get(ENDS_AT_SHUTDOWN)):
            # as when the client hangs up: receive() answers http.disconnect, the stream
            # stops, and the server no longer counts the connection
            self.transport.close()
            return
        super().shutdown()


class GuardedHttpProtocol(StreamsEndAtShutdown):
    """uvicorn's httptools protocol with request deadlines and a per-client cap (see the
    module docstring), whose marked streams end at shutdown. :func:`protocol_class` makes
    one subclass per server."""

    limits: ClassVar[ConnectionLimits]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_phase: Stage | None = None
        self._peer = self.client[0] if self.client else ""
        self._admitted = self.limits.admit(self._peer)
        if not self._admitted:
            transport.write(_plain(b"429 Too Many Requests",
                                   f"over {self.limits.per_client} open connections from "
                                   f"{self._peer}", b"retry-after: 1\r\n"))
            transport.close()
            return
        self._arm("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._admitted:
            self._admitted = False
            self.limits.release(self._peer)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        phase = self._phase()
        if phase == "done":
            self._disarm()
        elif phase == "body" and self._deadline_phase != "body":
            self._arm("body")
        elif phase == "head" and self._deadline is None:
            self._arm("head")  # the first byte of the next request on this connection

    def _phase(self) -> Stage:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return "head"
        return "body" if cycle.more_body else "done"

    def _arm(self, phase: Stage) -> None:
        self._disarm()
        delay = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._deadline = self.loop.call_later(delay, self._expired)
        self._deadline_phase = phase

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._deadline_phase = None

    def _expired(self) -> None:
        self._deadline = self._deadline_phase = None
        phase = self._phase()
        if phase == "done" or self.transport.is_closing():
            return
        self.limits.timed_out += 1
        cycle = self.cycle
        if phase == "head" or not cycle.response_started:
            what = "headers" if phase == "head" else "body"
            limit = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            self.transport.write(_plain(b"408 Request Timeout",
                                        f"the request's {what} did not arrive within "
                                        f"{limit:g} s"))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() sees a disconnect, its sends drop
            cycle.message_event.set()
        self.transport.close()


def protocol_class(server: ServerSettings) -> type[GuardedHttpProtocol]:
    """A protocol class with its own limits and counters, for one uvicorn server."""
    limits = ConnectionLimits(server)
    return type("GatewayHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's config for the gateway: the bind address, keep-alive and graceful
    shutdown from ``settings.server``, and :class:`GuardedHttpProtocol`."""
    server = settings.server
    options: dict[str, Any] = {
        "host": server.host, "port": server.port, "access_log": False,
        "http": protocol_class(server),
        "timeout_keep_alive": int(server.keep_alive_s),
        "timeout_graceful_shutdown": int(server.shutdown_grace_s),
    }
    return uvicorn.Config(app, **(options | overrides))
