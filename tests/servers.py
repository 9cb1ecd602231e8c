"""Run ASGI apps on real sockets in a background thread (sync and async clients both work).

Tests fake at process boundaries: the gateway under test, simulated vLLM servers and
purpose-built upstreams all listen on 127.0.0.1 like the real thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from gateway.config import ServerSettings

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that are free, for servers that take
    a run of ports (``sim-backend --count``, ``serve --shards``).

    Chosen below the kernel's ephemeral range: outgoing connections take their local
    ports from that range, so a port there that is free now can be taken by a client
    socket before the server binds it (a shard once failed to start with EADDRINUSE)."""
    rng = random.Random()
    top = _ephemeral_low() - n
    for _ in range(500):
        port = rng.randrange(10000, top)
        if all(_can_bind(port + k) for k in range(n)):
            return port
    raise RuntimeError(f"no {n} consecutive free ports below {top + n}")


class LoopThread:
    """An event loop in a daemon thread; ``run`` executes a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 60) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


async def serve_app(app: Any, port: int) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    # idle connections kept as the gateway keeps them (``server.keep_alive_s``): uvicorn's
    # own 5 s equals httpx's pool expiry, and a loaded machine then races a request on a
    # pooled connection against its close (a ReadError in tests/web/test_browser.py)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on", access_log=False, timeout_graceful_shutdown=5,
                            timeout_keep_alive=int(ServerSettings().keep_alive_s))
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during start-up")
        await asyncio.sleep(0.01)
    return server, task


async def stop_app(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 15)


@contextlib.contextmanager
def app_in_thread(
    loop: LoopThread, app_factory: Callable[[], Any], port: int | None = None
) -> Iterator[str]:
    """Serve ``app_factory()`` on a free port of the loop thread; yield its base URL."""
    port = port or free_port()
    server, task = loop.run(serve_app(app_factory(), port))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.run(stop_app(server, task))


async def forget_updates(url: str) -> None:
    """Put an engine a test reuses back as a fresh one: no weight label (vLLM's
    ``"default"``), no LoRA adapter. A gateway takes over what the engines it starts on
    hold (gateway/weights/adopt.py), so one test's updates would be the next one's
    starting point; routes an engine does not serve are skipped."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        try:
            await http.post("/update_weight_version", json={"new_version": "default"})
        except httpx.TransportError:
            return  # nothing listens there (a test's dead backend)
        r = await http.get("/v1/models")
        cards = r.json().get("data", []) if r.status_code == 200 else []
        for card in cards:
            if isinstance(card, dict) and card.get("parent") not in (None, card.get("id")):
                await http.post("/v1/unload_lora_adapter", json={"lora_name": card["id"]})


def forget_updates_of(loop: LoopThread, urls: list[str]) -> None:
    """:func:`forget_updates` of every engine in ``urls``."""
    for url in urls:
        loop.run(forget_updates(url))


def two_sim_servers(loop: LoopThread) -> Iterator[list[str]]:
    """Two simulated vLLM servers (qwen3-14b on H100, 50x time, short answers) for a
    module-scoped fixture to ``yield from``; their base URLs."""
    from backends.sim.runner import start_sim_servers
    from backends.sim.state import SimServerConfig

    configs = [SimServerConfig(model="qwen3-14b", gpu="H100", speed=50, seed=i,
                               scheduling_policy="priority", output_len_median=30)
               for i in range(2)]
    cm = start_sim_servers(configs)
    urls = loop.run(cm.__aenter__())
    yield urls
    loop.run(cm.__aexit__(None, None, None))
