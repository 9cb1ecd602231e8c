"""Slow and greedy clients on real sockets, served as ``rollout-gateway serve`` serves:
request header and body deadlines, and the cap on one client's connections
(gateway/serving.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import ServerSettings
from gateway.serving import uvicorn_config
from tests.gateway.conftest import make_settings
from tests.scripted_upstream import Script
from tests.servers import LoopThread, free_port

CHAT = b'{"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}'


@contextlib.contextmanager
def served(loop_thread: LoopThread, db: str, backends: list[str],
           **server: object) -> Iterator[tuple[str, uvicorn.Config]]:
    port = free_port()
    settings = make_settings(db, backends, server=ServerSettings(port=port, **server))
    config = uvicorn_config(create_app(settings), settings, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    srv = uvicorn.Server(config)

    async def start() -> asyncio.Task[None]:
        srv.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        task = asyncio.create_task(srv.serve())
        while not srv.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        return task

    async def stop(task: asyncio.Task[None]) -> None:
        srv.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 15)

    task = loop_thread.run(start())
    try:
        yield f"http://127.0.0.1:{port}", config
    finally:
        loop_thread.run(stop(task))


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed."""
    sock.settimeout(limit_s)
    data, start = b"", time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - start


@pytest.fixture
def upstream(scripted) -> str:
    return scripted(Script(tokens=3, token_delay_s=0.5))[0]


def test_headers_that_trickle_in_are_cut_off(loop_thread, sqlite_url, upstream):
    with served(loop_thread, sqlite_url, [upstream], header_timeout_s=0.5) as (url, _):
        sock = _connect(url)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(20):  # one byte every 0.1 s, never finishing the headers
                sock.sendall(b"x")
                time.sleep(0.1)
        data, _ = _read_all(sock, 5)
        sock.close()
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"headers did not arrive within 0.5 s" in data
        assert time.monotonic() - started < 3
        with _connect(url) as idle:  # a connection that never sends a byte is closed too
            data, waited = _read_all(idle, 5)
        assert data.startswith(b"HTTP/1.1 408") and waited < 2


def test_a_body_that_does_not_arrive_is_cut_off(loop_thread, sqlite_url, upstream):
    with served(loop_thread, sqlite_url, [upstream], body_timeout_s=0.5) as (url, _):
        with _connect(url) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 400\r\n\r\n"
                         b"{\"mo")
            data, waited = _read_all(sock, 5)
        assert data.startswith(b"HTTP/1.1 408"), data
        assert b"body did not arrive within 0.5 s" in data and waited < 2
        # the gateway still serves, and a call slower than both deadlines is never cut:
        # they cover receiving the request, not answering it
        r = httpx.post(f"{url}/v1/chat/completions", content=CHAT,
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 200


def test_a_long_stream_outlives_the_deadlines(loop_thread, sqlite_url, upstream):
    with served(loop_thread, sqlite_url, [upstream], header_timeout_s=0.3,
                body_timeout_s=0.3) as (url, _), httpx.Client(timeout=30) as http:
        for _ in range(2):  # the keep-alive connection is reused for the second call
            started = time.monotonic()
            with http.stream("POST", f"{url}/v1/chat/completions", headers={
                    "Content-Type": "application/json"},
                    content=CHAT[:-1] + b', "stream": true}') as r:
                text = b"".join(r.iter_bytes())
            assert r.status_code == 200 and text.endswith(b"data: [DONE]\n\n")
            assert time.monotonic() - started > 1.0  # three tokens 0.5 s apart


def test_one_client_holds_at_most_its_share_of_connections(loop_thread, sqlite_url, upstream):
    with served(loop_thread, sqlite_url, [upstream], max_connections_per_client=5,
                header_timeout_s=30) as (url, config), contextlib.ExitStack() as stack:
        held = [stack.enter_context(_connect(url)) for _ in range(5)]
        time.sleep(0.2)
        with _connect(url) as extra:
            data, _ = _read_all(extra, 5)
        assert data.startswith(b"HTTP/1.1 429"), data
        assert b"over 5 open connections from 127.0.0.1" in data
        limits = config.http_protocol_class.limits  # type: ignore[attr-defined]
        assert limits.open["127.0.0.1"] == 5 and limits.refused == 1
        held[0].close()
        time.sleep(0.2)
        r = httpx.get(f"{url}/health", timeout=5)  # a slot is free again
        assert r.status_code == 200


def test_a_thousand_slow_connections_are_all_closed(loop_thread, sqlite_url, upstream):
    """Issue 28: 1,000 connections sending a byte a second stayed open after 41 s."""
    with served(loop_thread, sqlite_url, [upstream], header_timeout_s=1.0) as (url, _):
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(_connect(url)) for _ in range(1000)]
            for sock in socks:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
            deadline = time.monotonic() + 10
            open_ = list(socks)
            while open_ and time.monotonic() < deadline:
                still = []
                for sock in open_:
                    try:
                        sock.sendall(b"x")
                        still.append(sock)
                    except OSError:
                        pass
                open_ = still
                time.sleep(0.5)
        assert not open_, f"{len(open_)} of 1000 trickling connections still open after 10 s"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
