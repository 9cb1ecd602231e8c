"""What the client hands back: trajectory summaries, admin jobs and batches of samples.

The answers are parsed with the models the routes declare (:mod:`gateway.schema`), so
the client and the gateway cannot disagree on a shape, and reading a sample needs
neither the server nor its database. Tables use ``SAMPLE_SCHEMA``, so a batch fetched
over REST and a file written by ``rollout-gateway export`` have the same columns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import TypeAdapter

from gateway.schema.jobs import JobStatus, JobView
from gateway.schema.samples import GroupSamples, GroupTrees, Sample, SampleList, SampleTree
from gateway.schema.table import samples_table
from gateway.schema.trajectories import (
    FinishedTrajectory,
    TrajectoryDetail,
    TrajectoryInfo,
    TrajectoryPage,
)

__all__ = ["JobInfo", "SampleBatch", "TrajectoryInfo"]

_SAMPLE = TypeAdapter(Sample)
_TREE = TypeAdapter(SampleTree)


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
        """From a job's JSON, as little as ``id`` and ``status`` (what ``JobFailed`` is
        given); answers of the gateway go through :func:`job_from_json`."""
        return cls(id=str(d["id"]), kind=str(d.get("kind", "")),
                   status=JobStatus(d["status"]), errors=list(d.get("errors") or []), raw=d)

    def __getitem__(self, key: str) -> Any:
        """The job's JSON by key (``job["phases"]``), as when jobs were plain dicts."""
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


def job_from_json(d: Any) -> JobInfo:
    """``GET /admin/jobs/{id}``, read with the route's model; ``raw`` keeps the JSON."""
    job = JobView.model_validate(d)
    return JobInfo(id=job.id, kind=job.kind, status=job.status, errors=job.errors, raw=d)


def waiting_for_weights(job: JobInfo) -> bool:
    """A weight-update job has paused the engines and waits for the new weights."""
    return any(p.get("name") == "update" for p in job.raw.get("phases") or ())


def sample_from_json(d: Any) -> Sample:
    """The ``Sample`` of ``GET /trajectories/{id}/sample`` (keys it does not know are
    left out: a newer gateway may send more)."""
    return _SAMPLE.validate_python(d)


def samples_from_json(d: Any) -> list[Sample]:
    """The samples of ``/trajectories/{id}/samples`` (one per branch)."""
    return SampleList.model_validate(d).data


def group_samples_from_json(d: Any) -> list[Sample]:
    """The samples of ``GET /groups/{id}/samples``, each trajectory's branches together."""
    return GroupSamples.model_validate(d).data


def tree_from_json(d: Any) -> SampleTree:
    """The ``SampleTree`` of ``GET /trajectories/{id}/tree``."""
    return _TREE.validate_python(d)


def group_trees_from_json(d: Any) -> list[SampleTree]:
    """The trees of ``GET /groups/{id}/trees``, by creation time."""
    return GroupTrees.model_validate(d).data


def infos_from_json(d: Any) -> list[TrajectoryInfo]:
    """The rows of one ``GET /trajectories`` page."""
    return TrajectoryPage.model_validate(d).data


def finished_from_json(d: Any) -> TrajectoryInfo:
    """The answer of ``POST /trajectories/{id}/finish`` as a row."""
    return FinishedTrajectory.model_validate(d).info()


def detail_info(d: Any) -> TrajectoryInfo:
    """The row of a trajectory from ``GET /trajectories/{id}`` (its calls counted)."""
    return TrajectoryDetail.model_validate(d).info()


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
        """One row per sample (branch), columns of ``gateway.schema.table.SAMPLE_SCHEMA``."""
        return samples_table(self.samples)

    def to_parquet(self, path: str | Path) -> Path:
        """Write :meth:`to_table` to ``path``; read it back with ``pyarrow.parquet``."""
        out = Path(path)
        pq.write_table(self.to_table(), out)
        return out
