"""The states of an admin job (``GET /admin/jobs/{id}``), shared by the job book and the
client."""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    PENDING = "pending"  # waiting for an earlier reconfiguration to finish
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # finished, but some step failed (see ``errors``)
    CANCELLED = "cancelled"  # the gateway shut down first
