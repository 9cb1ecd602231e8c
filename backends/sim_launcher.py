"""Simulated vLLM servers as a launcher: one in-process uvicorn server per instance.

Used by the demo, the benchmarks and the pool tests: reconfigurations take milliseconds
instead of the minute a real vLLM needs to load weights, while the latency model still
gives each instance the speed of its TP degree. ``crash`` stops a server behind the pool
manager's back, which is how tests and chaos demos exercise restart-on-crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn

from backends.base import InstanceSpec, LaunchedInstance, LaunchError
from backends.sim.server import create_sim_app
from backends.sim.state import SimServerConfig


class _QuietServer(uvicorn.Server):
    """Leaves signal handling to the host process (many servers share its loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(slots=True)
class _Hosted:
    server: _QuietServer
    task: asyncio.Task[None]
    sock: socket.socket
    stopped: bool = False


class SimLauncher:
    """Starts :mod:`backends.sim` servers for (``profile``, ``gpu``, ``spec.tp``).

    The server answers to ``spec.model``; ``options`` are further ``SimServerConfig``
    fields (``output_len_median``, ``tp_penalty``, ...). Instance ``n`` gets seed
    ``seed + n`` so outputs differ between instances.
    """

    name = "sim"

    def __init__(self, *, profile: str = "qwen3-14b", gpu: str = "H100", speed: float = 1.0,
                 seed: int = 0, options: Mapping[str, Any] | None = None,
                 host: str = "127.0.0.1") -> None:
        self.profile, self.gpu, self.speed, self.seed = profile, gpu, speed, seed
        self.options = dict(options or {})
        self.host = host
        self._started = 0
        self._running: dict[int, LaunchedInstance] = {}

    def config(self, spec: InstanceSpec) -> SimServerConfig:
        opts: dict[str, Any] = {"scheduling_policy": "priority", **self.options}
        return SimServerConfig(model=self.profile, gpu=self.gpu, tp=spec.tp,
                               served_model_name=spec.model, speed=self.speed,
                               seed=self.seed + self._started, **opts)

    async def start(self, spec: InstanceSpec) -> LaunchedInstance:
        try:
            config = self.config(spec)
            config.profile()
        except (TypeError, ValueError) as exc:
            raise LaunchError(f"{spec.id}: {exc}") from exc
        self._started += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        server = _QuietServer(uvicorn.Config(
            create_sim_app(config), log_level="warning", access_log=False, lifespan="on",
            timeout_graceful_shutdown=1))
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"sim-{spec.id}")
        hosted = _Hosted(server, task, sock)
        while not server.started:
            if task.done():
                sock.close()
                raise LaunchError(f"{spec.id}: simulated server exited during start")
            await asyncio.sleep(0.01)
        port = sock.getsockname()[1]
        instance = LaunchedInstance(spec=spec, url=f"http://{self.host}:{port}", handle=hosted,
                                    meta={"port": str(port), "profile": config.profile().key})
        self._running[id(hosted)] = instance
        return instance

    async def stop(self, instance: LaunchedInstance, *, grace_s: float = 10.0) -> None:
        hosted = _hosted(instance)
        self._running.pop(id(hosted), None)
        if hosted.stopped:
            return
        hosted.stopped = True
        hosted.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(hosted.task), grace_s)
        except TimeoutError:
            hosted.task.cancel()
        except Exception:  # a server that crashed earlier: nothing left to stop
            pass
        hosted.sock.close()

    async def alive(self, instance: LaunchedInstance) -> bool:
        hosted = _hosted(instance)
        return not hosted.stopped and not hosted.task.done()

    async def crash(self, instance: LaunchedInstance) -> None:
        """Kill the server without telling anyone (for crash-restart tests and demos)."""
        hosted = _hosted(instance)
        hosted.server.should_exit = True
        with contextlib.suppress(Exception):
            await hosted.task
        hosted.sock.close()

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(i, grace_s=2.0) for i in list(self._running.values())))


def _hosted(instance: LaunchedInstance) -> _Hosted:
    if not isinstance(instance.handle, _Hosted):
        raise TypeError(f"{instance.spec.id} was not started by SimLauncher")
    return instance.handle
