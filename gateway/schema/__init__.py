"""What the gateway's REST API answers, typed once for the routes and the trainer client.

Pure data: pydantic models and dataclasses, importing nothing of the server (no store,
dispatch, API, FastAPI or SQLAlchemy; an import contract in ``pyproject.toml`` holds
this), so ``gateway.client`` reads a sample without the server installed. The routes
declare these as their response models, so the OpenAPI document is typed; the store
builds ``Sample`` from its rows.

  ids.py           ID_PATTERN: what a trajectory or group id may be
  samples.py       Sample, CallSpan, Mismatch; SampleList, GroupSamples
  trajectories.py  TrajectoryInfo (a list row), TrajectoryPage, TrajectoryDetail
                   (CallTrace, LiveView), FinishedTrajectory, HarnessKey
  jobs.py          JobStatus, JobView, JobList, JobRef, PoolChangeRef (admin jobs)
  weights.py       WeightVersionChange (PUT /admin/weight-version)
  table.py         SAMPLE_SCHEMA and samples_table (Arrow; export and client)
"""

from gateway.schema.ids import ID_PATTERN
from gateway.schema.jobs import JobList, JobRef, JobStatus, JobView, PoolChangeRef
from gateway.schema.samples import Branches, CallSpan, GroupSamples, Mismatch, Sample, SampleList
from gateway.schema.trajectories import (
    CallTrace,
    FinishedTrajectory,
    HarnessKey,
    LiveView,
    TrajectoryDetail,
    TrajectoryInfo,
    TrajectoryPage,
    Usage,
)
from gateway.schema.weights import WeightVersionChange

__all__ = [
    "ID_PATTERN",
    "Branches",
    "CallSpan",
    "CallTrace",
    "FinishedTrajectory",
    "GroupSamples",
    "HarnessKey",
    "JobList",
    "JobRef",
    "JobStatus",
    "JobView",
    "LiveView",
    "Mismatch",
    "PoolChangeRef",
    "Sample",
    "SampleList",
    "TrajectoryDetail",
    "TrajectoryInfo",
    "TrajectoryPage",
    "Usage",
    "WeightVersionChange",
]
