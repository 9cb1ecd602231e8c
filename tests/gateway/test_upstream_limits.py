"""The idle and total limits of a streamed upstream body (one timer per response)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest
from aiohttp import web

from gateway.config import UpstreamSettings
from gateway.errors import UpstreamTimeout
from gateway.proxy.upstream import open_upstream


async def _trickle(request: web.Request) -> web.StreamResponse:
    """``n`` chunks, ``gap`` seconds apart (until the reader goes away)."""
    n, gap = int(request.query["n"]), float(request.query["gap"])
    resp = web.StreamResponse()
    await resp.prepare(request)
    with contextlib.suppress(ConnectionError):
        for i in range(n):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(gap)
        await resp.write_eof()
    return resp


async def _read(n: int, gap: float, *, idle: float, total: float,
                consume_s: float = 0.0) -> tuple[list[bytes], BaseException | None, float]:
    app = web.Application()
    app.router.add_post("/", _trickle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    settings = UpstreamSettings(idle_timeout_s=idle, total_timeout_s=total)
    got: list[bytes] = []
    error: BaseException | None = None
    started = time.monotonic()
    try:
        async with aiohttp.ClientSession() as session:
            up = await open_upstream(session, f"http://127.0.0.1:{port}/?n={n}&gap={gap}",
                                     b"{}", {}, settings)
            try:
                async for chunk in up.chunks():
                    got.append(chunk)
                    await asyncio.sleep(consume_s)  # a slow client: not the upstream's time
            except UpstreamTimeout as exc:
                error = exc
            finally:
                took = time.monotonic() - started
                up.close()
    finally:
        await runner.cleanup()
    return got, error, took


def test_a_steady_stream_is_not_cut() -> None:
    got, error, _ = asyncio.run(_read(6, 0.05, idle=0.3, total=10))
    assert error is None and b"".join(got).count(b"data:") == 6


def test_a_stalled_stream_is_cut_at_the_idle_limit() -> None:
    got, error, took = asyncio.run(_read(3, 1.0, idle=0.3, total=10))
    assert isinstance(error, UpstreamTimeout) and "idle" in error.message
    assert b"".join(got) == b"data: 0\n\n" and 0.3 <= took < 0.9


def test_a_stream_past_the_total_limit_is_cut_though_never_idle() -> None:
    got, error, took = asyncio.run(_read(40, 0.05, idle=0.3, total=0.6))
    assert isinstance(error, UpstreamTimeout) and "total" in error.message
    assert 4 <= b"".join(got).count(b"data:") < 40 and took < 1.2


def test_time_spent_on_a_slow_client_is_not_upstream_idleness() -> None:
    # each chunk takes the consumer 0.25 s; the upstream answers within 0.05 s
    got, error, _ = asyncio.run(_read(4, 0.05, idle=0.2, total=10, consume_s=0.25))
    assert error is None and b"".join(got).count(b"data:") == 4


def test_a_cancelled_reader_is_cancelled_not_timed_out() -> None:
    async def main() -> None:
        task = asyncio.create_task(_read(5, 1.0, idle=5, total=10))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
