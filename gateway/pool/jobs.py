"""Asynchronous admin jobs (pool reconfigurations, drains) and their visible progress.

A reconfiguration takes from milliseconds (simulated servers) to minutes (vLLM loading
weights), far longer than an HTTP request should stay open, so the admin API answers
``202`` with a job id at once and ``GET /admin/jobs/{id}`` shows the phases as they run,
with timings and errors. Only the last ``MAX_JOBS`` jobs are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.schema.jobs import JobStatus

__all__ = ["Job", "JobBook", "JobPhase", "JobStatus"]

MAX_JOBS = 200


@dataclass(slots=True)
class JobPhase:
    name: str
    started: float
    finished: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        end = self.finished if self.finished is not None else time.time()
        return {"name": self.name, "started": self.started, "finished": self.finished,
                "duration_s": round(end - self.started, 3), **self.detail}


@dataclass(slots=True)
class Job:
    id: str
    kind: str
    request: dict[str, Any]
    status: JobStatus = JobStatus.PENDING
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    phases: list[JobPhase] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.status not in (JobStatus.PENDING, JobStatus.RUNNING)

    def begin(self) -> None:
        self.status, self.started = JobStatus.RUNNING, time.time()

    def end(self, status: JobStatus | None = None) -> None:
        """Finish; without ``status``: succeeded unless an error was recorded."""
        self.finished = time.time()
        self.status = status or (JobStatus.FAILED if self.errors else JobStatus.SUCCEEDED)

    @contextlib.contextmanager
    def phase(self, name: str, **detail: Any) -> Iterator[JobPhase]:
        """Record a timed phase; the caller may add to ``phase.detail`` while it runs."""
        ph = JobPhase(name, time.time(), detail=dict(detail))
        self.phases.append(ph)
        try:
            yield ph
        finally:
            ph.finished = time.time()

    def to_dict(self) -> dict[str, Any]:
        end = self.finished if self.finished is not None else time.time()
        return {
            "id": self.id, "kind": self.kind, "status": self.status.value,
            "request": self.request, "created": self.created, "started": self.started,
            "finished": self.finished,
            "duration_s": round(end - self.started, 3) if self.started else None,
            "plan": self.plan, "phases": [p.to_dict() for p in self.phases],
            "errors": self.errors,
        }


class JobBook:
    """The recent jobs by id (ids are small increasing integers, as strings)."""

    def __init__(self, max_jobs: int = MAX_JOBS) -> None:
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._ids = itertools.count(1)
        self._max = max_jobs
        self._tasks: set[asyncio.Task[None]] = set()

    def track(self, task: asyncio.Task[None]) -> None:
        """Hold a reference to a job's task until it ends (the loop keeps only weak ones)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the jobs still running (gateway shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def create(self, kind: str, request: dict[str, Any]) -> Job:
        job = Job(id=str(next(self._ids)), kind=kind, request=request)
        self._jobs[job.id] = job
        while len(self._jobs) > self._max:
            self._jobs.popitem(last=False)
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def recent(self, n: int = 20) -> list[Job]:
        return list(self._jobs.values())[-n:][::-1]

    @property
    def running(self) -> int:
        return sum(1 for j in self._jobs.values() if not j.done)
