"""The trajectory API's answers (``/trajectories``), as the routes declare them and the
client reads them. The field order is the wire order; every field is always sent (null
when unknown), except a call's text, which only ``include_text=true`` adds."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PlainSerializer


def _iso(value: datetime) -> str:
    return value.isoformat()


#: a time sent as Python's ``isoformat()`` (``+00:00``, as the gateway always has), not
#: pydantic's ``Z``
IsoTime = Annotated[datetime, PlainSerializer(_iso, return_type=str, when_used="json")]


class LiveView(BaseModel):
    """The gateway's live view of a trajectory while it tracks it."""

    phase: str
    attempt: int
    turns: int
    in_flight: int
    queued: int
    context_tokens: int
    llm_time_s: float
    tool_time_s: float
    queue_time_s: float
    mismatches: int
    backend_id: str | None


class TrajectoryInfo(BaseModel):
    """One row of ``GET /trajectories`` (the client also makes one from a finish answer
    or from ``GET /trajectories/{id}``)."""

    model_config = ConfigDict(frozen=True)

    id: str
    group_id: str | None
    created_at: IsoTime | None = None
    finished_at: IsoTime | None
    reward: float | None
    calls: int = 0
    completion_tokens: int = 0
    #: the gateway's live view while the trajectory is tracked (phase, turns, ...)
    live: LiveView | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


class TrajectoryPage(BaseModel):
    """``GET /trajectories``: a page of rows, oldest first."""

    object: Literal["list"] = "list"
    data: list[TrajectoryInfo]
    limit: int
    offset: int


class Usage(BaseModel):
    prompt_tokens: int | None
    completion_tokens: int | None


class CallTrace(BaseModel):
    """One stored call with its token trace (``GET /trajectories/{id}``)."""

    id: str
    attempt: int
    seq: int
    endpoint: str
    model: str
    status: str
    error: str | None
    finish_reason: str | None
    backend_id: str | None
    tp: int | None
    weight_version: str
    weight_segments: list[Any] | None
    started_at: IsoTime
    queued_ms: float
    ttft_ms: float | None
    total_ms: float
    prompt_len: int
    prompt_offset: int
    mismatch_pos: int | None
    branch: int
    parent_branch: int | None
    kept_len: int | None
    requested_model: str | None
    constrained: str | None = None  # a forced tool call or structured output
    prompt_delta_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float] | None
    usage: Usage
    extra_choices: Any
    #: only with ``include_text=true`` (admin token)
    request_messages: Any = None
    completion_text: str | None = None


class TrajectoryDetail(BaseModel):
    """``GET /trajectories/{id}``: the trajectory and every call of every attempt."""

    id: str
    attempt: int
    group_id: str | None
    created_at: IsoTime
    finished_at: IsoTime | None
    reward: float | None
    rewards: dict[str, float] | None = None  # each policy's own, where the trainer gave them
    metadata: dict[str, Any] | None
    live: LiveView | None
    calls: list[CallTrace]

    def info(self) -> TrajectoryInfo:
        """The row this trajectory has in ``GET /trajectories``."""
        tokens = sum(c.usage.completion_tokens or 0 for c in self.calls)
        return TrajectoryInfo(id=self.id, group_id=self.group_id, created_at=self.created_at,
                              finished_at=self.finished_at, reward=self.reward,
                              calls=len(self.calls), completion_tokens=tokens, live=self.live)


class FinishedTrajectory(BaseModel):
    """``POST /trajectories/{id}/finish``."""

    id: str
    attempt: int
    group_id: str | None
    reward: float | None
    finished_at: IsoTime | None
    rewards: dict[str, float] | None = None

    def info(self) -> TrajectoryInfo:
        return TrajectoryInfo(id=self.id, group_id=self.group_id, reward=self.reward,
                              finished_at=self.finished_at)


class HarnessKey(BaseModel):
    """``POST /trajectories/{id}/key``: a key for this trajectory's model calls only."""

    key: str
    trajectory_id: str
    group_id: str | None
