"""``SimLauncher``: the launcher protocol over in-process simulated vLLM servers.

The pool manager resizes and re-shards a simulated pool exactly as it would a real one:
``start`` brings up a server with the TP degree of the spec (after a simulated start-up
delay, Libra measures ~10.8 s for a real vLLM, so reconfiguration is not free in the
demo either) and ``stop`` shuts it down, aborting whatever it was running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from dataclasses import dataclass

from backends.base import InstanceSpec, LaunchedInstance, LaunchError
from backends.sim.hosting import QuietServer, bind, sim_server
from backends.sim.state import SimServerConfig


@dataclass(slots=True)
class _Running:
    server: QuietServer
    task: asyncio.Task[None]
    sock: socket.socket


class SimLauncher:
    """Starts simulated servers in this event loop; ``template`` sets everything but
    ``model``, ``tp`` and ``seed`` (taken from the spec)."""

    name = "sim"

    def __init__(self, template: SimServerConfig | None = None, *, host: str = "127.0.0.1",
                 startup_s: float = 10.8) -> None:
        self.template = template or SimServerConfig()
        self.host = host
        self.startup_s = startup_s  # simulated seconds, on the server's clock
        self._running: dict[str, LaunchedInstance] = {}

    def config_for(self, spec: InstanceSpec) -> SimServerConfig:
        seed = self.template.seed + sum(map(ord, spec.id))
        return dataclasses.replace(self.template, model=spec.model, tp=spec.tp, seed=seed,
                                   weights_path=spec.weights_path
                                   or self.template.weights_path)

    async def start(self, spec: InstanceSpec) -> LaunchedInstance:
        try:
            config = self.config_for(spec)
            config.profile()
        except ValueError as exc:
            raise LaunchError(str(exc)) from exc
        await config.make_clock().sleep(self.startup_s)
        sock = bind(self.host, 0)
        server = sim_server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                sock.close()
                raise LaunchError(f"simulated server {spec.id} exited during start")
            await asyncio.sleep(0.01)
        url = f"http://{self.host}:{sock.getsockname()[1]}"
        inst = LaunchedInstance(spec, url, handle=_Running(server, task, sock),
                                meta={"profile": config.profile().key})
        self._running[spec.id] = inst
        return inst

    async def stop(self, instance: LaunchedInstance, *, grace_s: float = 10.0) -> None:
        running = instance.handle
        if not isinstance(running, _Running):
            return
        self._running.pop(instance.spec.id, None)
        running.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(running.task), grace_s)
        except TimeoutError:
            running.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running.task
        running.sock.close()

    async def alive(self, instance: LaunchedInstance) -> bool:
        running = instance.handle
        return isinstance(running, _Running) and not running.task.done()

    async def close(self) -> None:
        for inst in list(self._running.values()):
            await self.stop(inst, grace_s=2.0)
