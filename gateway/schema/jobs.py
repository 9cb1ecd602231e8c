"""Admin jobs as the API answers them (``GET /admin/jobs/{id}``), shared by the job book,
the admin routes and the client."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel


class JobStatus(enum.StrEnum):
    PENDING = "pending"  # waiting for an earlier reconfiguration to finish
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # finished, but some step failed (see ``errors``)
    CANCELLED = "cancelled"  # the gateway shut down first


class JobView(BaseModel):
    """``GET /admin/jobs/{id}``: a job with its plan and timed phases (each phase is its
    ``name``, ``started``, ``finished``, ``duration_s`` and what the step recorded)."""

    id: str
    kind: str
    status: JobStatus
    request: dict[str, Any]
    created: float
    started: float | None
    finished: float | None
    duration_s: float | None
    plan: dict[str, Any]
    phases: list[dict[str, Any]]
    errors: list[str]


class JobList(BaseModel):
    """``GET /admin/jobs``: the recent jobs."""

    data: list[JobView]


class JobRef(BaseModel):
    """The answer of a request that started a job (``202``): poll ``url``."""

    job: str
    status: JobStatus
    url: str


class PoolChangeRef(JobRef):
    """``PUT /admin/pool``: the job, and the ids of the instances it plans."""

    planned: list[str]
