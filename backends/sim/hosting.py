"""One simulated server as a uvicorn server, and the listening socket it serves on.

Shared by ``backends.sim.runner`` (many servers in one process) and
``backends.sim.launcher`` (the sim launcher of a managed pool); kept below both so that
neither imports the other and ``backends.sim.server`` (the app) imports neither.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Generator

import uvicorn

from backends.sim.server import create_sim_app
from backends.sim.state import SimServerConfig


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host (several share a loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def sim_server(config: SimServerConfig) -> QuietServer:
    ucfg = uvicorn.Config(create_sim_app(config), log_level="warning", access_log=False,
                          lifespan="on", timeout_graceful_shutdown=1)
    return QuietServer(ucfg)


def bind(host: str, port: int) -> socket.socket:
    # proto must be IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets whose
    # proto says TCP, and without it Nagle + delayed ACK add 40 ms to every response.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
