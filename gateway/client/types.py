"""What the client hands back: trajectory summaries, admin jobs and batches of samples.

Training samples are the gateway's own :class:`gateway.store.samples.Sample` (rebuilt
from ``GET /trajectories/{id}/sample``), and tables use the exporter's ``SAMPLE_SCHEMA``,
so a batch fetched over REST and a file written by ``rollout-gateway export`` have the
same columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from gateway.dispatch.jobs import JobStatus
from gateway.store.export import samples_table
from gateway.store.samples import CallSpan, Mismatch, Sample

T = TypeVar("T")


def _dt(value: Any) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) else None


def _known(cls: type[T], data: dict[str, Any]) -> T:
    """``cls(**data)`` keeping only the fields ``cls`` has (the server may add more)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, slots=True)
class TrajectoryInfo:
    """One row of ``GET /trajectories`` (or the answer of a finish)."""

    id: str
    group_id: str | None
    reward: float | None
    finished_at: datetime | None
    created_at: datetime | None = None
    calls: int = 0
    completion_tokens: int = 0
    #: the gateway's live view while the trajectory is tracked (phase, turns, ...)
    live: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrajectoryInfo:
        """From a list row, a finish answer, or ``GET /trajectories/{id}`` (calls listed)."""
        calls, tokens = d.get("calls") or 0, d.get("completion_tokens") or 0
        if isinstance(calls, list):
            tokens = sum(int((c.get("usage") or {}).get("completion_tokens") or 0)
                         for c in calls)
            calls = len(calls)
        return cls(id=d["id"], group_id=d.get("group_id"), reward=d.get("reward"),
                   finished_at=_dt(d.get("finished_at")), created_at=_dt(d.get("created_at")),
                   calls=int(calls), completion_tokens=int(tokens), live=d.get("live"))


@dataclass(frozen=True, slots=True)
class JobInfo:
    """An admin job (``GET /admin/jobs/{id}``); ``raw`` has its plan and timed phases."""

    id: str
    kind: str
    status: JobStatus
    errors: list[str]
    raw: dict[str, Any]

    @property
    def done(self) -> bool:
        return self.status not in (JobStatus.PENDING, JobStatus.RUNNING)

    @property
    def succeeded(self) -> bool:
        return self.status is JobStatus.SUCCEEDED

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobInfo:
        return cls(id=str(d["id"]), kind=str(d.get("kind", "")),
                   status=JobStatus(d["status"]), errors=list(d.get("errors") or []), raw=d)

    def __getitem__(self, key: str) -> Any:
        """The job's JSON by key (``job["phases"]``), as when jobs were plain dicts."""
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


def waiting_for_weights(job: JobInfo) -> bool:
    """A weight-update job has paused the engines and waits for the new weights."""
    return any(p.get("name") == "update" for p in job.raw.get("phases") or ())


def sample_from_json(d: dict[str, Any]) -> Sample:
    """Rebuild the gateway's ``Sample`` from the JSON of ``/trajectories/{id}/sample``."""
    return Sample(
        trajectory_id=d["trajectory_id"], group_id=d.get("group_id"), reward=d.get("reward"),
        token_ids=list(d["token_ids"]), loss_mask=list(d["loss_mask"]),
        logprobs=[float(x) for x in d["logprobs"]],
        weight_versions=list(d.get("weight_versions") or []),
        calls=[_known(CallSpan, c) for c in d.get("calls") or []],
        mismatches=[_known(Mismatch, m) for m in d.get("mismatches") or []],
        metadata=d.get("metadata"), attempt=int(d.get("attempt") or 0),
        max_staleness=d.get("max_staleness"), branch=int(d.get("branch") or 0),
        parent_branch=d.get("parent_branch"), fork_position=int(d.get("fork_position") or 0),
        main=bool(d.get("main", True)), num_branches=int(d.get("num_branches") or 1),
    )


def samples_from_json(d: dict[str, Any]) -> list[Sample]:
    """The samples of ``/trajectories/{id}/samples`` (one per branch)."""
    return [sample_from_json(item) for item in d.get("data") or []]


@dataclass(slots=True)
class SampleBatch:
    """Training samples of a batch, in the order they were asked for (a trajectory's
    branches one after another, by branch id, when every branch was asked for)."""

    samples: list[Sample]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    @property
    def num_mismatches(self) -> int:
        return sum(len(s.mismatches) for s in self.samples)

    def by_trajectory(self) -> dict[str, list[Sample]]:
        """Each trajectory's samples (its branches): what GRPO advantages go by, since
        every branch of a trajectory carries that trajectory's reward."""
        out: dict[str, list[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.trajectory_id, []).append(s)
        return out

    def by_group(self) -> dict[str | None, list[Sample]]:
        out: dict[str | None, list[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.group_id, []).append(s)
        return out

    def to_table(self) -> pa.Table:
        """One row per sample (branch), columns of ``gateway.store.export.SAMPLE_SCHEMA``."""
        return samples_table(self.samples)

    def to_parquet(self, path: str | Path) -> Path:
        """Write :meth:`to_table` to ``path``; read it back with ``pyarrow.parquet``."""
        out = Path(path)
        pq.write_table(self.to_table(), out)
        return out
