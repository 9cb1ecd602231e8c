"""``create_app(settings)``: the FastAPI app and its lifespan. Nothing runs at import."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api import (
    admin,
    count_tokens,
    gemini,
    groups,
    openai,
    policy,
    staleness,
    status,
    training,
    trajectories,
    viewer,
    web,
)
from gateway.api.browser import BrowserGuard
from gateway.api.deps import Access
from gateway.api.errors import BodyLimit, install_error_handlers
from gateway.config import ServerSettings, Settings
from gateway.proxy.relay import Proxy
from gateway.readiness import announced
from gateway.runtime import open_runtime
from gateway.weights.adopt import adopt


class GatewayApp(FastAPI):
    """FastAPI, with the OpenAI completion routes answered before its middleware and
    router (:func:`gateway.api.openai.serve_raw`: the hot path); CORS, when configured,
    wraps that path too, and the browser checks (:mod:`gateway.api.browser`) come first
    on every path."""

    def __init__(self, *, raw: ASGIApp, server: ServerSettings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raw = raw
        self.guarded = BrowserGuard(self.route_request, server)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.guarded(scope, receive, send)

    async def route_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The raw completion path, or FastAPI."""
        route = openai.raw_route(scope)
        if route is None or "proxy" not in scope.get("state", ()):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        scope["rg.route"] = route
        await self.raw(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    access = Access(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with open_runtime(settings, adopt) as rt:
            app.state.runtime = rt  # for embedding code (tests, demo); routes use request.state
            async with announced(rt, wait=settings.server.wait_ready):
                yield {"rt": rt, "proxy": Proxy(rt), "access": access}

    raw: ASGIApp = openai.serve_raw
    if settings.server.cors_origins:
        raw = CORSMiddleware(raw, allow_origins=settings.server.cors_origins,
                             allow_methods=["*"], allow_headers=["*"])
    app = GatewayApp(
        raw=raw, server=settings.server,
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
    for module in (openai, count_tokens, gemini, trajectories, viewer, groups, training,
                   admin, staleness, policy, status, web):
        app.include_router(module.router)
    return app
