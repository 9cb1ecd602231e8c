"""Draining: take a backend out of placement, let its in-flight calls finish, then act.

Used by the pool manager before stopping an instance and by ``DELETE /admin/backends``
for externally managed backends, so that removing capacity never fails a call that is
already running. What "draining" means for placement is spelled out in
``gateway.dispatch.dispatcher``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from backends.base import ServerState
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.pool.jobs import Job, JobBook, JobStatus

POLL_S = 0.05


async def wait_idle(backends: Sequence[Backend], timeout_s: float) -> list[str]:
    """Wait until no call is in flight on ``backends``; the ids still busy at timeout."""
    deadline = time.monotonic() + timeout_s
    while busy := [b.id for b in backends if b.in_flight > 0]:
        if time.monotonic() >= deadline:
            return busy
        await asyncio.sleep(POLL_S)
    return []


async def drain(job: Job, backends: Sequence[Backend], timeout_s: float) -> None:
    """Mark ``backends`` draining and wait for them to be idle, as a phase of ``job``."""
    with job.phase("drain", instances=[b.id for b in backends],
                   in_flight={b.id: b.in_flight for b in backends}) as ph:
        for b in backends:
            b.state = ServerState.DRAINING
        forced = await wait_idle(backends, timeout_s)
        if forced:
            ph.detail["forced"] = forced
            job.errors.append(f"drain timed out after {timeout_s:.0f} s with calls still "
                              f"in flight on {forced}; stopped anyway")


def start_remove_job(registry: BackendRegistry, jobs: JobBook, backend: Backend,
                     timeout_s: float) -> Job:
    """Drain an externally managed backend, then unregister it (in the background)."""
    job = jobs.create("remove-backend", {"id": backend.id, "url": backend.url})

    async def run() -> None:
        job.begin()
        try:
            await drain(job, [backend], timeout_s)
            with job.phase("remove"):
                registry.remove(backend.id)
        except asyncio.CancelledError:
            job.end(JobStatus.CANCELLED)
            raise
        job.end()

    jobs.track(asyncio.create_task(run(), name=f"remove-{backend.id}"))
    return job
