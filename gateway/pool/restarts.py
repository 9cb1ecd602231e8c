"""Crash detection and restarts for the managed pool's instances.

Every ``check_interval_s`` the watch asks the launcher whether each ready or draining
instance is alive. One that died while ready, failed to start, or serves weights other
than the pool's is marked failed and restarted on the current weights after an
exponential backoff (``restart.backoff_s`` doubling up to ``restart.backoff_max_s``), up to
``restart.max_restarts`` times. A restart runs under the pool's job lock, so it never
interleaves with a reconfiguration, and it is dropped when a reconfiguration replaced or
removed the instance meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from backends.base import InstanceSpec, Launcher, ServerState
from gateway.loops import Periodic
from gateway.pool.instance import PoolInstance
from gateway.pool.spec import PoolSpec

if TYPE_CHECKING:
    from gateway.metrics import EventLog
    from gateway.pool.jobs import JobBook

log = logging.getLogger(__name__)


class _Host(Protocol):
    @property
    def events(self) -> EventLog: ...
    @property
    def jobs(self) -> JobBook: ...


class RestartPool(Protocol):
    """What restarts need of the pool (:class:`gateway.pool.manager.PoolManager`)."""

    spec: PoolSpec
    launcher: Launcher
    instances: dict[str, PoolInstance]
    job_lock: asyncio.Lock

    @property
    def rt(self) -> _Host: ...
    async def stop_instance(self, inst: PoolInstance) -> None: ...
    async def start_instance(self, spec: InstanceSpec, restarts: int = 0) -> PoolInstance: ...


class Restarts:
    """The pool's crash watch and the restarts it (or a failed start) schedules."""

    def __init__(self, pool: RestartPool) -> None:
        self.pool = pool
        self.pending = 0  # restarts scheduled and not yet done (capacity is coming)
        self.watch = Periodic("pool-watch", self._check_all_alive,
                              pool.spec.check_interval_s, logger=log)

    async def _check_all_alive(self) -> None:
        for inst in list(self.pool.instances.values()):
            if inst.state in (ServerState.READY, ServerState.DRAINING):
                await self._check_alive(inst)

    async def _check_alive(self, inst: PoolInstance) -> None:
        if inst.launched is None:
            return
        try:
            alive = await self.pool.launcher.alive(inst.launched)
        except Exception:  # a launcher bug: do not restart on it
            log.exception("alive() of %s failed", inst.spec.id)
            return
        if alive or inst.state not in (ServerState.READY, ServerState.DRAINING):
            return
        was_ready = inst.state is ServerState.READY
        inst.error = "the server exited"
        inst.set_state(ServerState.FAILED)
        self.pool.rt.events.emit("backend", f"{inst.spec.id} crashed", backend=inst.spec.id,
                                 state="failed")
        if was_ready:  # a draining instance was on its way out anyway
            self.schedule(inst)

    def schedule(self, inst: PoolInstance) -> None:
        """Restart the failed ``inst`` after its backoff, unless it used up its restarts."""
        policy, events = self.pool.spec.restart, self.pool.rt.events
        if inst.restarts >= policy.max_restarts:
            events.emit("backend", f"{inst.spec.id}: gave up after {inst.restarts} restarts",
                        backend=inst.spec.id)
            return
        delay = min(policy.backoff_s * 2**inst.restarts, policy.backoff_max_s)
        self.pending += 1
        self.pool.rt.jobs.track(asyncio.create_task(self._restart(inst, delay),
                                                    name=f"restart-{inst.spec.id}"))

    async def _restart(self, inst: PoolInstance, delay: float) -> None:
        pool = self.pool
        try:
            await asyncio.sleep(delay)
            async with pool.job_lock:
                if pool.instances.get(inst.spec.id) is not inst:
                    return  # a reconfiguration replaced or removed it meanwhile
                await pool.stop_instance(inst)
                n = inst.restarts + 1
                pool.rt.events.emit("backend", f"{inst.spec.id}: restart {n} of "
                                    f"{pool.spec.restart.max_restarts}", backend=inst.spec.id)
                await pool.start_instance(inst.spec, restarts=n)
        finally:
            self.pending -= 1
