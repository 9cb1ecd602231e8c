"""Health checks against a real server whose ``/v1/models`` reply is not OpenAI's shape:
the backend is marked unhealthy with a clear reason and the checks go on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gateway.config import UpstreamSettings
from gateway.dispatch.backends import Backend, BackendRegistry, HealthChecker, model_ids
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
    async with aiohttp.ClientSession() as session:
        checker = HealthChecker(registry, session, settings)
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
