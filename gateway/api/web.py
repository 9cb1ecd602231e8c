"""The status page (``GET /``), its static assets, and the live stream it listens to.

``GET /status/stream`` is server-sent events: one ``status`` event (the ``/status`` JSON)
per interval. Each stream ends after ``STREAM_LIFETIME_S`` and the browser's EventSource
reconnects on its own (``retry``), so an open page never holds up a graceful shutdown
for long and a proxy that buffers or cuts long responses costs at most one interval.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import FileResponse, Response, StreamingResponse

from gateway.api.deps import get_rt, is_admin
from gateway.api.status import status_body
from gateway.errors import NotFound
from gateway.runtime import Runtime
from gateway.serving import ENDS_AT_SHUTDOWN

router = APIRouter(tags=["status"])
STREAM_LIFETIME_S = 15.0
ASSET_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Everything the page needs comes from this origin; no inline script, no third parties.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def asset_path(name: str) -> Path:
    """The file of one page asset; 404 for anything that is not a plain asset name."""
    suffix = Path(name).suffix
    if "/" in name or "\\" in name or name.startswith(".") or suffix not in ASSET_TYPES:
        raise NotFound(f"no asset {name!r}")
    path = Path(str(importlib.resources.files("web"))) / name
    if not path.is_file():
        raise NotFound(f"no asset {name!r}")
    return path


def _file(name: str) -> FileResponse:
    path = asset_path(name)
    return FileResponse(path, media_type=ASSET_TYPES[path.suffix], headers=PAGE_HEADERS)


@router.get("/", include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@router.get("/view", include_in_schema=False)
@router.get("/view/{path:path}", include_in_schema=False)
async def viewer_page(path: str = "") -> Response:
    """The trajectory viewer (``/view/trajectories/{id}``, ``/view/groups/{id}``,
    ``/view/search``): one page, which reads its data with the caller's token."""
    return _file("viewer.html")


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    return _file(name)


@router.get("/status/stream", summary="The /status JSON as server-sent events",
            response_class=StreamingResponse)
async def status_stream(
    request: Request,
    rt: Runtime = Depends(get_rt),
    interval: float = Query(1.0, ge=0.25, le=10.0, description="seconds between events"),
) -> StreamingResponse:
    request.scope[ENDS_AT_SHUTDOWN] = True
    events = status_events(rt, interval, with_urls=is_admin(request))
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def status_events(rt: Runtime, interval: float, *, with_urls: bool,
                        lifetime: float = STREAM_LIFETIME_S) -> AsyncIterator[bytes]:
    yield b"retry: 1000\n\n"
    deadline = time.monotonic() + lifetime
    while rt.ready and time.monotonic() < deadline:
        body = status_body(rt, with_urls=with_urls)
        yield b"event: status\ndata: " + orjson.dumps(body) + b"\n\n"
        await asyncio.sleep(interval)
