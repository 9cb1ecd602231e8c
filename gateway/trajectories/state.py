"""What the gateway knows of one trajectory and one GRPO group while they run.

The :class:`~gateway.trajectories.tracker.Tracker` holds and changes these; policies read
them through cached views (``gateway.dispatch.views``), which only the tracker's methods
(for a trajectory) and the group's own (for a group) drop.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.policies.base import Phase
from gateway.trajectories.branches import Tree
from gateway.trajectories.tools import ToolOutcome

if TYPE_CHECKING:
    from gateway.policies.base import GroupView, TrajectoryView

# Timeline kept per trajectory for the status page's Gantt: (kind, start, end) triples
# packed in an array of doubles, the most recent MAX_SEGMENTS only (bounded memory).
SEGMENT_KINDS = ("queue", "llm", "tool")
MAX_SEGMENTS = 64


@dataclass(slots=True)
class TrajectoryState:
    id: str
    group_id: str | None
    created_at: float
    attempt: int = 0  # which run of this id (a finished id called again opens the next)
    turns: int = 0  # calls that arrived in this attempt
    recorded: int = 0  # calls recorded in this attempt: the next record's ``seq``
    calls_done: int = 0
    calls_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_time_s: float = 0.0
    queue_time_s: float = 0.0
    tool_time_s: float = 0.0
    last_call_end: float | None = None
    queued: int = 0
    in_flight: int = 0
    mismatches: int = 0
    backend_id: str | None = None
    outcomes: list[ToolOutcome] = field(default_factory=list)
    tree: Tree = field(default_factory=Tree)
    finished_at: float | None = None
    reward: float | None = None
    last_queue_s: float = 0.0
    timeline: array[float] = field(default_factory=lambda: array("d"))
    prompt_id: str | None = None  # identity of the task prompt (same across a GRPO group)
    model: str | None = None
    last_completion_tokens: int = 0
    preferred_backend: str | None = None  # a migration target whose cache was prewarmed
    auto: bool = False  # untagged call: a one-call trajectory, never continued
    #: the policies' cached view of it (``gateway.dispatch.views``); None when stale. Only
    #: the tracker's methods that change what it shows drop it (:func:`_changes_view`)
    view: TrajectoryView | None = None
    final_context: int = 0  # context length at finish (the sequence itself is released)
    aborted: str | None = None  # why the trainer aborted this attempt (calls are refused)
    #: per model it called (a served model or a LoRA family), the weight version served
    #: for it when its first call for that model arrived: what staleness is judged from
    first_versions: dict[str, str] = field(default_factory=dict)
    last_model: str | None = None  # the model its latest call was for

    @property
    def phase(self) -> Phase:
        if self.finished_at is not None:
            return Phase.FINISHED
        if self.in_flight:
            return Phase.GENERATING
        if self.queued:
            return Phase.QUEUED
        return Phase.TOOL

    @property
    def sequence(self) -> array[int]:
        """The main branch's tokens (prompt + completion of the last call)."""
        return self.tree.sequence

    @property
    def context_tokens(self) -> int:
        return self.final_context if self.finished_at is not None else len(self.sequence)

    def add_segment(self, kind: int, start: float, end: float) -> None:
        """Record ``SEGMENT_KINDS[kind]`` over [start, end] (epoch seconds)."""
        if end - start < 1e-3:  # sub-millisecond slivers are invisible and cost memory
            return
        self.timeline.extend((kind, start, end))
        if len(self.timeline) > 3 * MAX_SEGMENTS:
            del self.timeline[:3]

    def segments(self) -> Iterator[tuple[str, float, float]]:
        t = self.timeline
        for i in range(0, len(t), 3):
            yield SEGMENT_KINDS[int(t[i])], t[i + 1], t[i + 2]


@dataclass(frozen=True, slots=True)
class TurnFacts:
    """What the request side knew of a call, for placing it in the tree."""

    expected: int | None = None  # the branch its messages continued
    digests: tuple[bytes, ...] = ()  # its request messages (gateway.trajectories.branches)
    said: Counter[str] | None = None  # the words of the turn the model produced
    routes: tuple[int, int] | None = None  # positions whose routed experts it recorded
    model: str = ""  # the model (policy) it ran for: whose routes those are


@dataclass(slots=True)
class GroupState:
    """A GRPO group as observed: its members and what finished members generated."""

    members: list[str] = field(default_factory=list)
    finished_lengths: list[int] = field(default_factory=list)
    finished_turns: list[int] = field(default_factory=list)
    view: GroupView | None = None  # the policies' cached view; its methods drop it

    def join(self, trajectory_id: str) -> None:
        if trajectory_id not in self.members:
            self.members.append(trajectory_id)
        self.view = None

    def leave(self, trajectory_id: str) -> None:
        if trajectory_id in self.members:
            self.members.remove(trajectory_id)
            self.view = None

    def member_finished(self, tokens: int, turns: int) -> None:
        self.finished_lengths.append(tokens)
        self.finished_turns.append(turns)
        self.view = None
