"""Is the gateway ready for traffic? ``GET /ready``, ``/health``'s body, ``serve --wait-ready``.

A gateway with a managed pool answers HTTP within a second of starting, but its engines
take from seconds (simulated) to many minutes (vLLM loading a large model). Liveness and
readiness are therefore two questions:

- *live* (``GET /health`` 200): the process serves HTTP; 503 only while it shuts down.
  Kubernetes' liveness probe and load balancers' health checks ask this; it must not fail
  during a long engine start, or the gateway would be restarted in a loop;
- *ready* (``GET /ready`` 200, else 503): the pool's initial layout has been started and
  at least one of its engines came up (without a managed pool: as soon as it serves),
  and the trace writer can record calls (while it cannot, model calls are refused:
  :attr:`gateway.store.writer.TraceWriter.refusal`).

Readiness is not withdrawn when a later resize or crash restart leaves no engine
routable for a while: the gateway holds calls until capacity returns
(``DISPATCH__BACKEND_WAIT_S``), so taking it out of a Service would turn held calls into
connection errors. Only an initial layout of which no engine came up stays not ready
(until a restart brings one up).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from backends.base import ServerState
from gateway.pool.manager import PoolManager
from gateway.runtime import Runtime

log = logging.getLogger(__name__)
POLL_S = 0.25


class NotReady(RuntimeError):
    """The pool cannot become ready (no engine of its initial layout came up)."""


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str
    engines_ready: int = 0
    engines_planned: int = 0
    since: float | None = None  # when the initial layout was done
    failed: bool = False  # the initial layout is done and none of it came up

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "failed"}


def _started(pool: PoolManager) -> list[str]:
    """Engines of the initial job that came up (phases ``start*`` record their seconds)."""
    job = pool.initial
    if job is None:
        return []
    return [iid for ph in job.phases if ph.name.startswith("start")
            for iid, s in (ph.detail.get("start_s") or {}).items() if s is not None]


def readiness(rt: Runtime) -> Readiness:
    """The gateway's readiness now (module docstring)."""
    if not rt.ready:
        return Readiness(False, "shutting down")
    if (refusal := rt.writer.refusal) is not None:
        return Readiness(False, f"not recording, model calls refused: {refusal}")
    pool = rt.pool
    if pool is None:
        return Readiness(True, "serving (no managed pool)")
    up = sum(1 for i in pool.instances.values() if i.state is ServerState.READY)
    planned = len(pool.planned)
    job = pool.initial
    if job is None or not job.done:
        where = f" (job {job.id})" if job is not None else ""
        return Readiness(False, f"starting the pool{where}: {up} of {planned} engines up",
                         up, planned)
    if _started(pool) or any(b.routable for b in rt.registry):
        return Readiness(True, f"pool ready: {up} of {planned} engines up", up, planned,
                         job.finished)
    errors = "; ".join(job.errors)[:500] or "no engine started"
    return Readiness(False, f"no engine of the initial layout came up: {errors}", up,
                     planned, job.finished, failed=True)


async def wait_until_ready(rt: Runtime, *, give_up: bool = True) -> Readiness:
    """Return once ready. NotReady when the gateway stops first, or (``give_up``) when no
    engine of the initial layout came up; else a warning and a wait for a restart."""
    warned = False
    while not (state := readiness(rt)).ready:
        if not rt.ready or (state.failed and give_up):
            raise NotReady(state.reason)
        if state.failed and not warned:
            log.warning("%s; waiting for a restart", state.reason)
            warned = True
        await asyncio.sleep(POLL_S)
    return state


def _announce(rt: Runtime, state: Readiness, started: float) -> None:
    message = f"{state.reason} ({time.monotonic() - started:.1f} s after start)"
    log.info("%s", message)
    rt.events.emit("pool", message)


@contextlib.asynccontextmanager
async def announced(rt: Runtime, *, wait: bool) -> AsyncIterator[None]:
    """Log (and put in the event list) when the gateway becomes ready. With ``wait``,
    do not return before it is (so ``serve --wait-ready`` binds its port only then), and
    raise NotReady if it cannot be."""
    started = time.monotonic()
    if rt.pool is None:
        yield
        return
    if wait:
        _announce(rt, await wait_until_ready(rt), started)
        yield
        return

    async def watch() -> None:
        with contextlib.suppress(NotReady):
            _announce(rt, await wait_until_ready(rt, give_up=False), started)

    task = asyncio.create_task(watch(), name="readiness")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
