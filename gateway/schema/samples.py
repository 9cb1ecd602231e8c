"""A training sample as the gateway answers it and the trainer reads it.

``Sample`` is a plain dataclass, so the store builds it call by call without validation
on the hot path (``gateway.store.samples``); pydantic reads it from JSON on the client
and describes it in the OpenAPI document. The field order is the wire order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

#: which branches of a trajectory become samples: every one (default; each generated
#: token trained in exactly one), the main one (the task's conversation, trained whole),
#: or the one training the most generated tokens
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
    #: a forced tool call or structured output (``tool_choice``, ``json_schema``, ...):
    #: its logprobs are those of the distribution the engine masked to the grammar
    constrained: str | None = None


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
    fork_position: int = 0  # tokens taken from the parent (trained there unless main)
    main: bool = True  # the task's conversation (gateway/store/samples.py), trained whole
    num_branches: int = 1
    #: MoE routing replay: the experts each position was routed to, base64 of a ``.npy``
    #: int16 ``(len(token_ids), layers, top_k)``, -1 where no route is known (the last
    #: token, positions the engine did not report); None when no call recorded any
    routed_experts: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.calls[0].completion_start if self.calls else len(self.token_ids)


@dataclass(slots=True)
class TreeBranch:
    """One branch of a :class:`SampleTree`: its sequence is the path from a root to
    ``leaf`` (node indices)."""

    branch: int
    parent_branch: int | None
    leaf: int  # -1 for a branch without tokens
    length: int  # tokens on the path (the branch's sequence length)
    main: bool


@dataclass(slots=True)
class SampleTree:
    """One attempt of a trajectory as a prefix tree: each token any of its branches holds,
    once. ``parents[i]`` is the node before node ``i`` in every sequence holding it (-1 at
    a root), ``positions[i]`` its position in them; parents come before their children.
    ``loss_mask`` is 1 on every generated token (each exactly once, in the context it was
    generated in), ``logprobs`` and ``weight_versions`` as in :class:`Sample` (0.0 and
    ``""`` on prompt tokens). A trainer computes every logprob in one forward pass with a
    tree attention mask (node ``i`` attends to its ancestors and itself) and these
    position ids: :mod:`gateway.client.trees`."""

    trajectory_id: str
    group_id: str | None
    reward: float | None
    attempt: int = 0
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    branches: list[TreeBranch] = field(default_factory=list)
    metadata: dict[str, Any] | None = None
    max_staleness: int | None = None
    #: MoE routing replay: each node's routed experts, as :class:`Sample`'s (one row per
    #: node, -1 unknown); None when no call recorded any
    routed_experts: str | None = None

    def path(self, leaf: int) -> list[int]:
        """The node indices from a root to ``leaf``: one branch's sequence."""
        out = []
        while leaf >= 0:
            out.append(leaf)
            leaf = self.parents[leaf]
        return out[::-1]


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


class GroupTrees(BaseModel):
    """``GET /groups/{id}/trees``: every finished trajectory of a group, by creation time,
    each one's branches as one prefix tree."""

    object: Literal["list"] = "list"
    group_id: str
    finished: int
    trajectory_ids: list[str]
    data: list[SampleTree]
