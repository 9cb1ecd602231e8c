"""What became of the policy's layout proposals: proposed, applied, refused, and their cost.

A resource policy proposes a :class:`~gateway.policies.base.Relayout` (merge idle TP1
instances into a TP4, split a TP4); a managed pool applies it as a job (drain, stop,
start). The log keeps one record per proposal with the job that carries it out, and
reads the drain, stop and start durations off the job's phases when asked, so the status
page, the demo summary and ``bench live`` show what a live TP change actually cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.pool.jobs import Job, JobStatus


@dataclass(slots=True)
class RelayoutRecord:
    proposed_at: float
    retire: tuple[str, ...]
    launch: tuple[int, ...]
    reason: str
    job: Job | None = None  # None: not applied (``refused`` says why)
    refused: str | None = None

    @property
    def status(self) -> str:
        """``refused``, or the job's status (pending, running, succeeded, ...)."""
        return "refused" if self.job is None else self.job.status.value

    def phase_s(self, prefix: str) -> float:
        """Seconds spent in the job's phases named ``prefix...`` (``start`` and
        ``start-after-stop`` both count as ``start``)."""
        if self.job is None:
            return 0.0
        now = time.time()
        return round(sum((p.finished or now) - p.started for p in self.job.phases
                         if p.name.startswith(prefix)), 3)

    def to_dict(self) -> dict[str, Any]:
        job = self.job.to_dict() if self.job is not None else None
        return {"proposed_at": self.proposed_at, "retire": list(self.retire),
                "launch": list(self.launch), "reason": self.reason, "status": self.status,
                "refused": self.refused, "job": job["id"] if job else None,
                "started": job["started"] if job else None,
                "finished": job["finished"] if job else None,
                "duration_s": job["duration_s"] if job else None,
                "drain_s": self.phase_s("drain"), "stop_s": self.phase_s("stop"),
                "start_s": self.phase_s("start")}


class RelayoutLog:
    """Every proposal counted; those a job carried out kept with their jobs (one per pool
    reconfiguration, so few), the refused ones only as a count and the last reason."""

    def __init__(self) -> None:
        self.proposed = 0
        self.refused = 0
        self.applied: list[RelayoutRecord] = []  # with a job, whatever its outcome
        self.last_refusal: RelayoutRecord | None = None

    def record(self, now: float, retire: Sequence[str], launch: Sequence[int], reason: str,
               *, job: Job | None = None, refused: str | None = None) -> RelayoutRecord:
        rec = RelayoutRecord(now, tuple(retire), tuple(launch), reason, job, refused)
        self.proposed += 1
        if job is None:
            self.refused += 1
            self.last_refusal = rec
        else:
            self.applied.append(rec)
        return rec

    def summary(self, recent: int = 10) -> dict[str, Any]:
        """Counts by outcome, the total drain/stop/start seconds of the applied ones, the
        ``recent`` last ones a job carried out, and the last refusal."""
        done = [r for r in self.applied if r.job is not None
                and r.job.status is JobStatus.SUCCEEDED]
        running = sum(1 for r in self.applied if r.job is not None and not r.job.done)
        return {
            "proposed": self.proposed, "refused": self.refused, "applied": len(done),
            "in_progress": running, "failed": len(self.applied) - len(done) - running,
            "drain_s": round(sum(r.phase_s("drain") for r in done), 3),
            "stop_s": round(sum(r.phase_s("stop") for r in done), 3),
            "start_s": round(sum(r.phase_s("start") for r in done), 3),
            "recent": [r.to_dict() for r in self.applied[-recent:]],
            "last_refusal": None if self.last_refusal is None else self.last_refusal.to_dict(),
        }

    def spans(self) -> list[tuple[float, float | None, str]]:
        """(started, finished or None, label) of the relayouts a job ran, oldest first."""
        out = []
        for r in self.applied:
            if r.job is not None and r.job.started is not None:
                label = f"{'+'.join(r.retire)} -> TP{'+'.join(map(str, r.launch))}"
                out.append((r.job.started, r.job.finished, label))
        return out
