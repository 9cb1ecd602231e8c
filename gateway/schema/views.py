"""What the trajectory viewer reads (``/trajectories/{id}/view``, ``/groups/{id}/view``):
one attempt's calls with their timings, its branch tree with why each branch opened, and
one branch's sample laid out for reading. Training code reads the samples, not these.

The field order is the wire order. Text (the harness's messages, the completion text,
the tokens' pieces) is present only for the admin token, as on ``/trajectories/{id}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from gateway.schema.trajectories import IsoTime, LiveView

#: why a branch opened (gateway/store/views.py says how each is told)
BranchKind = Literal["first call", "side call", "changed system prompt", "dropped turn",
                     "edited turn", "edited history"]


class ViewCall(BaseModel):
    """One call of the attempt, with where its time went."""

    seq: int
    id: str
    branch: int
    parent_branch: int | None
    model: str
    requested_model: str | None
    endpoint: str
    status: str
    error: str | None
    finish_reason: str | None
    backend_id: str | None
    tp: int | None
    weight_version: str
    weight_segments: list[Any] | None
    started_at: float  # epoch seconds, when the gateway received it
    queued_ms: float  # in the gateway's queue
    llm_ms: float  # from dispatch to the call's end
    ttft_ms: float | None
    total_ms: float
    #: since the trajectory's previous call ended (its tool call, the harness's own
    #: work); None for the first call, or when calls overlapped
    tool_gap_ms: float | None
    prompt_len: int
    completion_len: int
    kept_len: int | None  # token in: prompt tokens run from the record
    mismatch_pos: int | None
    constrained: str | None
    #: the messages this call added (those after the last assistant turn), admin only
    messages: Any = None
    completion_text: str | None = None


class ViewBranch(BaseModel):
    """One branch of the attempt's tree."""

    branch: int
    parent_branch: int | None
    fork_position: int  # tokens shared with the parent
    opened_by: int | None  # the seq of the branch's first call
    kind: BranchKind
    reason: str  # the same, in a sentence with the positions and calls it rests on
    main: bool
    calls: list[int]  # seqs
    length: int  # tokens in the branch's sample
    trained: int  # tokens under loss mask 1 in its sample
    max_staleness: int | None


class ViewTokens(BaseModel):
    """One branch's sample as the viewer draws it. Spans are ``[start, end)`` positions."""

    branch: int
    main: bool
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float | None]  # None on context tokens
    #: [start, end, version] runs over the generated tokens
    versions: list[tuple[int, int, str]]
    #: [seq, prompt_start, completion_start, completion_end] per call of this branch (the
    #: positions before the first one it shares with the branch it forked from)
    calls: list[tuple[int, int, int, int]]
    #: [start, end, seq]: a turn the harness re-rendered, run from the record by call seq
    token_in: list[tuple[int, int, int]]
    mismatches: list[tuple[int, int]]  # [seq, position] where the harness's tokens left
    has_routes: bool
    #: each distinct id's text piece (admin token only; JSON keys are the ids as text)
    pieces: dict[int, str] | None = None
    pieces_note: str | None = None


class TrajectoryView(BaseModel):
    """``GET /trajectories/{id}/view``."""

    id: str
    attempt: int
    attempts: list[int]
    group_id: str | None
    reward: float | None  # the sample's: the attempt's, or with ``model`` that policy's
    rewards: dict[str, float] | None  # each policy's own, where the trainer gave them
    created_at: IsoTime
    finished_at: IsoTime | None
    metadata: dict[str, Any] | None
    live: LiveView | None
    current_version: str
    models: list[str]
    text: bool  # whether text was sent (the admin token)
    calls: list[ViewCall]
    branches: list[ViewBranch]
    tokens: ViewTokens | None  # None without a successful call


class GroupMember(BaseModel):
    """One trajectory of a group, as the group page compares them."""

    id: str
    attempt: int
    finished: bool
    reward: float | None
    #: GRPO's: (reward - the group's mean) / (its std + 1e-4), over finished trajectories
    #: with a reward, one each (gateway.client.advantages); None otherwise
    advantage: float | None
    #: reward - the group's mean (Dr. GRPO leaves the std out)
    advantage_unscaled: float | None
    calls: int
    branches: int
    length: int  # tokens in the main sample
    trained: int  # its generated tokens under loss mask 1
    generated: int  # generated tokens over every branch
    max_staleness: int | None  # of the main sample, against current_version
    versions: list[str]  # weight versions of its generated tokens, oldest first
    phase: str | None  # the live phase while the gateway tracks it


class GroupView(BaseModel):
    """``GET /groups/{id}/view``."""

    group_id: str
    current_version: str
    reward_mean: float | None
    reward_std: float | None
    members: list[GroupMember]
