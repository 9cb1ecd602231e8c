"""The one shared upstream HTTP client, with explicit timeouts at every stage.

aiohttp is used because it is markedly cheaper per request than httpx on the proxy's hot
path. Limits: ``connect`` (TCP connect), ``first byte`` (until response headers arrive),
``idle`` (between two body chunks) and ``total`` (whole call). Each violation raises
:class:`~gateway.errors.UpstreamTimeout` naming the stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping

import aiohttp

from gateway.config import UpstreamSettings
from gateway.errors import UpstreamError, UpstreamTimeout

#: what every call the gateway sends to an engine carries (JSON in, JSON or SSE out)
UPSTREAM_HEADERS = {"content-type": "application/json", "accept": "application/json"}


class UpstreamResponse:
    """An open upstream response. Always ``close()`` it (the relay does, on every path)."""

    def __init__(self, resp: aiohttp.ClientResponse, settings: UpstreamSettings,
                 deadline: float) -> None:
        self._resp = resp
        self._settings = settings
        self._deadline = deadline
        self.status = resp.status
        self.content_type = resp.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            async with asyncio.timeout(self._deadline - time.monotonic()):
                return await self._resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream exceeded the total time limit") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream failed while sending its answer: {exc}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive, with the idle and total limits applied."""
        content = self._resp.content
        watch = _Watch(self._settings.idle_timeout_s, self._deadline)
        loop = watch.loop
        try:
            while True:
                watch.started = now = loop.time()
                if now >= watch.deadline:
                    raise UpstreamTimeout("upstream exceeded the total time limit")
                if watch.handle is None:
                    watch.arm(now + watch.idle)
                watch.reading = True
                try:
                    chunk = await content.readany()
                except asyncio.CancelledError:
                    if watch.expired and watch.task.uncancel() == 0:
                        raise UpstreamTimeout(watch.expired) from None
                    raise
                except aiohttp.ClientError as exc:
                    raise UpstreamError(f"upstream connection broke mid-response: {exc}"
                                        ) from exc
                finally:
                    watch.reading = False
                if not chunk:
                    return
                yield chunk
        finally:
            watch.stop()

    def close(self) -> None:
        """Close the connection (not back to the pool unless fully read): frees the KV."""
        if not self._resp.closed:
            if self._resp.content.at_eof():
                self._resp.release()
            else:
                self._resp.close()


class _Watch:
    """The idle and total limits of one streamed body, with one timer per response
    rather than a timeout context per chunk (which cost more than relaying the chunk).

    Each read notes when it started; the timer, when it fires, cuts the read that has
    waited ``idle`` seconds (or ran into the deadline) by cancelling the reading task,
    else sets itself for the earliest moment the current read could; between reads it
    lapses and the next read sets it again."""

    __slots__ = (
        "deadline",
        "expired",
        "handle",
        "idle",
        "loop",
        "reading",
        "started",
        "task",
    )

    def __init__(self, idle: float, deadline: float) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.idle = idle
        # the deadline on the loop's clock (uvloop's is not time.monotonic())
        self.deadline = self.loop.time() + (deadline - time.monotonic())
        self.started = 0.0
        self.reading = False
        self.expired: str | None = None
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, at: float) -> None:
        self.handle = self.loop.call_at(min(at, self.deadline), self._fire)

    def _fire(self) -> None:
        self.handle = None
        if not self.reading:
            return
        now = self.loop.time()
        if now >= self.deadline:
            self.expired = "upstream exceeded the total time limit"
        elif now >= self.started + self.idle:
            self.expired = "upstream went idle mid-response"
        else:
            self.arm(self.started + self.idle)
            return
        self.task.cancel()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


async def open_upstream(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    settings: UpstreamSettings,
    deadline: float | None = None,
) -> UpstreamResponse:
    """POST ``body`` and wait for the response headers (the first-byte limit).

    ``deadline`` (``time.monotonic()``) bounds the whole call, retries included; without
    it the call gets ``total_timeout_s`` from now.
    """
    if deadline is None:
        deadline = time.monotonic() + settings.total_timeout_s
    wait = min(settings.first_byte_timeout_s, deadline - time.monotonic())
    if wait <= 0:
        raise UpstreamTimeout("upstream exceeded the total time limit")
    try:
        async with asyncio.timeout(wait):
            resp = await session.post(url, data=body, headers=headers)
    except aiohttp.ConnectionTimeoutError as exc:
        raise UpstreamConnectError(f"cannot connect to upstream: {exc}") from exc
    except TimeoutError as exc:
        raise UpstreamTimeout(f"no response from upstream within {wait:g}s") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(f"cannot connect to upstream: {exc}") from exc
    except aiohttp.ClientConnectionError as exc:
        raise UpstreamBroken(f"upstream closed the connection before answering: {exc}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"upstream request failed: {exc}") from exc
    return UpstreamResponse(resp, settings, deadline)


class UpstreamConnectError(UpstreamError):
    """The backend could not be reached at all (safe to retry elsewhere)."""


class UpstreamBroken(UpstreamError):
    """The backend dropped the connection before its response headers (it died or
    restarted while the call ran); nothing reached the client, so retrying is safe."""
