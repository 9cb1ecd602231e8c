"""A training sample as the gateway answers it and the trainer reads it.

``Sample`` is a plain dataclass, so the store builds it call by call without validation
on the hot path (``gateway.store.samples``); pydantic reads it from JSON on the client
and describes it in the OpenAPI document. The field order is the wire order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

#: which branches of a trajectory become samples: every one (default), the main one (the
#: branch of its last call), or the one with the most generated tokens
Branches = Literal["all", "main", "longest"]


@dataclass(slots=True)
class CallSpan:
    seq: int
    call_id: str
    prompt_start: int
    completion_start: int
    completion_end: int
    weight_version: str
    backend_id: str | None
    tp: int | None
    #: [[start, end, version], ...] relative to the call's completion, when the call ran
    #: across a weight update (``weight_version`` is then the first segment's).
    weight_segments: list[list[Any]] | None = None


@dataclass(slots=True)
class Mismatch:
    seq: int
    position: int
    previous_length: int


@dataclass(slots=True)
class Sample:
    trajectory_id: str
    group_id: str | None
    reward: float | None
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    calls: list[CallSpan] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    metadata: dict[str, Any] | None = None
    attempt: int = 0
    #: Versions behind ``current`` of the oldest completion token (numeric versions
    #: only; None when a version is not an integer or there is no completion).
    max_staleness: int | None = None
    branch: int = 0
    parent_branch: int | None = None  # the branch this one forked from
    fork_position: int = 0  # tokens taken from the parent (context, loss mask 0)
    main: bool = True  # the branch of the attempt's last call
    num_branches: int = 1

    @property
    def num_prompt_tokens(self) -> int:
        return self.calls[0].completion_start if self.calls else len(self.token_ids)


class SampleList(BaseModel):
    """``GET /trajectories/{id}/samples``: one sample per branch."""

    object: Literal["list"] = "list"
    data: list[Sample]


class GroupSamples(BaseModel):
    """``GET /groups/{id}/samples``: every finished trajectory of a group, by creation
    time, each one's branches together."""

    object: Literal["list"] = "list"
    group_id: str
    finished: int
    trajectory_ids: list[str]
    data: list[Sample]
