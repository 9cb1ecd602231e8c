"""Host the gateway and a simulated pool inside one process (demo, live benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence

import uvicorn

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from gateway.app import create_app
from gateway.config import Settings


class _EmbeddedServer(uvicorn.Server):
    """Leaves signal handling to the host program."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def serve_gateway(settings: Settings) -> AsyncIterator[str]:
    """Run the gateway on ``settings.server`` until the block exits; yields its URL."""
    host, port = settings.server.host, settings.server.port
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=5)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the gateway exited during start-up")
            await asyncio.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def sim_pool(configs: Sequence[SimServerConfig]) -> AsyncIterator[list[str]]:
    async with start_sim_servers(configs) as urls:
        yield urls
