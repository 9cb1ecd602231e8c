"""Health checks against a real server whose ``/v1/models`` reply is not OpenAI's shape:
the backend is marked unhealthy with a clear reason and the checks go on."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gateway.config import UpstreamSettings
from gateway.dispatch.backends import Backend, BackendRegistry, HealthChecker, model_ids
from tests.scripted_upstream import Script
from tests.servers import free_port, serve_app, stop_app


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An engine stand-in on a real socket; ``reply["models"]`` is what ``/v1/models``
    answers (the test changes it while the server runs)."""
    reply: dict[str, Any] = {"models": [{"id": "m", "object": "model"}]}  # a list: garbled
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(reply["models"])

    port = free_port()
    server, task = await serve_app(app, port)
    try:
        yield f"http://127.0.0.1:{port}", reply
    finally:
        await stop_app(server, task)


async def test_a_models_reply_that_is_a_list_marks_the_backend_unhealthy_and_checks_go_on(
        engine: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway")
    url, reply = engine
    registry = BackendRegistry()
    backend = registry.add(Backend(id="b0", url=url))
    settings = UpstreamSettings(health_interval_s=0.05, health_timeout_s=2.0)
    checker = HealthChecker(registry, settings)
    checker.start()
    try:
        await until(lambda: backend.consecutive_failures >= 3)
        assert checker.loop.running and checker.loop.failures == 0
        assert not backend.healthy and not backend.models
        assert backend.last_error is not None and "JSON list" in backend.last_error
        garbled = [r for r in caplog.records if "/v1/models answered" in r.getMessage()]
        assert len(garbled) == 1 and "b0" in garbled[0].getMessage()  # once, not per round

        reply["models"] = {"object": "list", "data": [{"id": "m", "object": "model"}]}
        await until(lambda: backend.healthy)
        assert backend.models == {"m"} and backend.consecutive_failures == 0
    finally:
        await checker.close()
    assert not checker.loop.running


@pytest.mark.parametrize("reply", [
    [], "text", 3, None, {"data": {"id": "m"}}, {"data": ["m"]}, {"data": None},
])
def test_replies_not_shaped_like_a_model_list_are_garbled(reply: object) -> None:
    with pytest.raises(ValueError, match="/v1/models answered"):
        model_ids(reply)


def test_model_ids_of_openai_shaped_replies() -> None:
    assert model_ids({"data": [{"id": "a"}, {"id": "b"}, {"object": "model"}]}) == {"a", "b"}
    assert model_ids({}) == set()  # an object without data lists no model, as before


def test_health_checks_pass_while_the_relays_pool_is_full(scripted, gateway_at, sqlite_url):
    """The relay's pool (2 connections here, 4,096 by default) full of long streams: the
    checks have connections of their own, so a working backend stays healthy and one added
    now is found healthy (sharing the pool, each check would time out waiting for it)."""
    busy, seen = scripted(Script(tokens=5, token_delay_s=0.8))
    other, _ = scripted(Script())
    upstream = {"max_connections": 2, "health_timeout_s": 0.5}
    with gateway_at(sqlite_url, [busy], upstream=upstream) as gw:
        body = {"model": "scripted", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        streams = [threading.Thread(target=httpx.post, args=(f"{gw}/v1/chat/completions",),
                                    kwargs={"json": body, "timeout": 30}) for _ in range(2)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 10
        while len(seen.bodies) < 2:  # both connections of the pool are streaming
            assert time.monotonic() < deadline
            time.sleep(0.01)
        added = httpx.post(f"{gw}/admin/backends", json={"url": other}, timeout=10).json()
        time.sleep(1.2)  # six rounds of the busy backend's checks (every 0.2 s)
        rows = {b["id"]: b for b in httpx.get(f"{gw}/status").json()["backends"]}
        assert seen.completed == 0  # still streaming: the pool is still full
        assert added["healthy"] is True, added
        assert rows["b0"]["healthy"] is True, rows["b0"]
        for t in streams:
            t.join(30)
