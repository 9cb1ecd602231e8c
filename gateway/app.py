"""``create_app(settings)``: the FastAPI app and its lifespan. Nothing runs at import."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from gateway.api import admin, openai, policy, status, trajectories, web
from gateway.config import Settings
from gateway.errors import BodyLimit, install_error_handlers
from gateway.proxy.relay import Proxy
from gateway.runtime import open_runtime


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with open_runtime(settings) as rt:
            app.state.runtime = rt  # for embedding code (tests, demo); routes use request.state
            yield {"rt": rt, "proxy": Proxy(rt)}

    app = FastAPI(
        title="rollout-gateway",
        version="0.1.0",
        description="Trajectory-aware OpenAI-compatible gateway for agentic RL rollouts.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.server.max_body_bytes)
    if settings.server.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.server.cors_origins,
            allow_methods=["*"], allow_headers=["*"],
        )
    for module in (openai, trajectories, admin, policy, status, web):
        app.include_router(module.router)
    return app
