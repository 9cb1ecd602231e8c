"""Ray: one actor per instance, in a placement group that holds the instance's GPUs.

RL stacks (verl, OpenRLHF, slime) already run a Ray cluster for training; placing the
rollout servers there lets training and rollout trade GPUs through Ray's accounting
instead of through hand-kept GPU lists. For each instance the launcher reserves one
bundle ``{"GPU": tp, "CPU": cpus_per_instance}`` (``STRICT_PACK``: tensor parallelism
stays inside one node), schedules a :class:`ServerActor` with ``num_gpus=tp`` into it,
and the actor starts the server on its node:

- ``server="vllm"``: a local ``vllm`` process (:class:`~backends.vllm_local.LocalVLLMLauncher`)
  which inherits the ``CUDA_VISIBLE_DEVICES`` Ray gave the actor, and runs TP with vLLM's
  own multiprocessing executor;
- ``server="sim"``: a simulated vLLM server (tests: a local cluster declaring logical
  GPUs, ``ray.init(num_gpus=8)``).

Ray is imported only when the launcher is used (the ``ray`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.base import InstanceSpec, LaunchedInstance, Launcher, LaunchError

log = logging.getLogger(__name__)
ALIVE_TIMEOUT_S = 10.0


class ServerActor:
    """Runs in a Ray worker: hosts one server with a local launcher, reports its URL."""

    def __init__(self, server: str, sim: dict[str, Any], vllm: dict[str, Any]) -> None:
        self.server, self.sim, self.vllm = server, sim, vllm
        self.launcher: Launcher | None = None
        self.instance: LaunchedInstance | None = None

    async def start(self, spec: InstanceSpec) -> str:
        from ray.util import get_node_ip_address

        node_ip: Callable[[], str] = get_node_ip_address  # untyped in Ray
        ip = node_ip()
        local = dataclasses.replace(spec, gpus=(), node="local")  # Ray already placed it
        if self.server == "sim":
            from backends.sim_launcher import SimLauncher

            self.launcher = SimLauncher(host=ip, **self.sim)
            self.instance = await self.launcher.start(local)
            return self.instance.url
        from backends.vllm_local import LocalVLLMLauncher

        opts = dict(self.vllm)
        log_dir = opts.pop("log_dir", None)
        self.launcher = LocalVLLMLauncher(host="0.0.0.0", log_dir=log_dir and Path(log_dir),
                                          **opts)
        self.instance = await self.launcher.start(local)
        return f"http://{ip}:{self.instance.meta['port']}"

    async def alive(self) -> bool:
        if self.launcher is None or self.instance is None:
            return False
        return await self.launcher.alive(self.instance)

    async def stop(self, grace_s: float) -> None:
        if self.launcher is not None and self.instance is not None:
            await self.launcher.stop(self.instance, grace_s=grace_s)


@dataclass(slots=True)
class _RayHandle:
    actor: Any
    pg: Any
    stopped: bool = False


class RayLauncher:
    """Places instances as Ray actors (see the module docstring).

    Connects with ``ray.init(address=address, **init_kwargs)`` unless Ray is already
    initialized in this process (then the existing connection is used and left alone).
    """

    name = "ray"

    def __init__(self, *, address: str | None = None, server: str = "vllm",
                 sim: dict[str, Any] | None = None, vllm: dict[str, Any] | None = None,
                 cpus_per_instance: float = 1.0, start_timeout_s: float = 600.0,
                 init_kwargs: dict[str, Any] | None = None) -> None:
        if server not in ("sim", "vllm"):
            raise ValueError(f"server must be 'sim' or 'vllm', not {server!r}")
        self.address, self.server = address, server
        self.sim, self.vllm = dict(sim or {}), dict(vllm or {})
        self.cpus_per_instance = cpus_per_instance
        self.start_timeout_s = start_timeout_s
        self.init_kwargs = dict(init_kwargs or {})
        self._owns_ray = False
        self._running: dict[int, LaunchedInstance] = {}

    async def _connect(self) -> Any:
        import ray

        if not ray.is_initialized():
            await asyncio.to_thread(ray.init, address=self.address, **self.init_kwargs)
            self._owns_ray = True
        return ray

    async def start(self, spec: InstanceSpec) -> LaunchedInstance:
        ray = await self._connect()
        pg = await self._reserve(spec)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                    placement_group_bundle_index=0)
        actor = ray.remote(ServerActor).options(
            num_gpus=spec.tp, num_cpus=self.cpus_per_instance, scheduling_strategy=strategy,
            max_restarts=0, name=f"rollout-{spec.id}-{uuid.uuid4().hex[:6]}",
        ).remote(self.server, self.sim, self.vllm)
        handle = _RayHandle(actor, pg)
        instance = LaunchedInstance(spec=spec, url="", handle=handle,
                                    meta={"placement_group": pg.id.hex()})
        try:
            instance.url = await asyncio.wait_for(actor.start.remote(spec), self.start_timeout_s)
        except BaseException as exc:
            await self.stop(instance, grace_s=5.0)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise LaunchError(f"{spec.id}: the server actor did not start: {exc}") from exc
        self._running[id(handle)] = instance
        return instance

    async def _reserve(self, spec: InstanceSpec) -> Any:
        """A placement group with one bundle of ``spec.tp`` GPUs, ready; or LaunchError."""
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"GPU": float(spec.tp)}
        if self.cpus_per_instance:
            bundle["CPU"] = self.cpus_per_instance
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"rollout-{spec.id}")
        try:
            await asyncio.wait_for(pg.ready(), self.start_timeout_s)
        except BaseException as exc:
            remove_placement_group(pg)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise LaunchError(f"{spec.id}: no node could reserve {bundle} within "
                              f"{self.start_timeout_s:.0f} s") from exc
        return pg

    async def stop(self, instance: LaunchedInstance, *, grace_s: float = 10.0) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        handle = _handle(instance)
        if handle.stopped:
            return
        handle.stopped = True
        self._running.pop(id(handle), None)
        with contextlib.suppress(Exception):  # a dead actor cannot stop anything
            await asyncio.wait_for(handle.actor.stop.remote(grace_s), grace_s + 5)
        with contextlib.suppress(Exception):
            ray.kill(handle.actor)
        with contextlib.suppress(Exception):
            remove_placement_group(handle.pg)

    async def alive(self, instance: LaunchedInstance) -> bool:
        handle = _handle(instance)
        if handle.stopped:
            return False
        try:
            return bool(await asyncio.wait_for(handle.actor.alive.remote(), ALIVE_TIMEOUT_S))
        except TimeoutError:
            log.warning("%s: actor did not answer within %.0f s; assuming alive",
                        instance.spec.id, ALIVE_TIMEOUT_S)
            return True
        except Exception:  # RayActorError and friends: the actor or its node is gone
            return False

    async def close(self) -> None:
        await asyncio.gather(*(self.stop(i) for i in list(self._running.values())))
        if self._owns_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)


def _handle(instance: LaunchedInstance) -> _RayHandle:
    if not isinstance(instance.handle, _RayHandle):
        raise TypeError(f"{instance.spec.id} was not started by RayLauncher")
    return instance.handle
