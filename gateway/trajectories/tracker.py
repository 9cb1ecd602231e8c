"""Live per-trajectory state: turns, tokens, time in the LLM and in tool calls.

The tracker is the gateway's working memory about each trajectory. It is updated on the
request path (cheap, synchronous) and read by the policies through snapshots. The store
is the source of truth for what was recorded; this is what is needed to decide.

Token sequence bookkeeping lives here too: each trajectory keeps a tree of branches
(``gateway.trajectories.branches``), each branch its last full sequence (prompt +
completion, packed ints), so that the next call's prompt is stored as a delta on the
branch it extends, and a call that extends none opens a branch of its own.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Concatenate, ParamSpec, TypeVar

from gateway.errors import TrajectoryAborted
from gateway.trajectories.branches import Placement, Tree
from gateway.trajectories.state import GroupState, TrajectoryState, TurnFacts
from gateway.trajectories.tools import ToolOutcome

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _changes_view(method: Callable[Concatenate[Tracker, TrajectoryState, _P], _R]
                  ) -> Callable[Concatenate[Tracker, TrajectoryState, _P], _R]:
    """Mark a :class:`Tracker` method that changes what its trajectory's view shows: the
    cached view is dropped when it returns. The one place a trajectory view goes stale,
    so a policy never reads a view older than the state it was built from."""
    @functools.wraps(method)
    def changing(self: Tracker, state: TrajectoryState, /, *args: _P.args,
                 **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, state, *args, **kwargs)
        finally:
            state.view = None
    return changing


class Tracker:
    """All live trajectories, least recently active evicted beyond ``capacity``.

    ``live`` holds the trajectories a policy should consider: seen, not finished, and not
    a one-call untagged trajectory whose call is over. Retired trajectories (finished, or
    untagged and done) are kept for the status page, the ``retain_retired`` most recent
    only, so a gateway serving for days holds memory for its live batch, not its history;
    live ones left idle are forgotten by :meth:`expire` (a harness that died never
    finishes its trajectory).
    """

    def __init__(self, capacity: int = 100_000, retain_retired: int = 2_000) -> None:
        self._states: OrderedDict[str, TrajectoryState] = OrderedDict()
        self._capacity = capacity
        self._retain = retain_retired
        self._retired: OrderedDict[str, None] = OrderedDict()
        self.live: dict[str, TrajectoryState] = {}
        self.groups: dict[str, GroupState] = {}
        self.finished_count = 0

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[TrajectoryState]:
        return iter(list(self._states.values()))

    def by_model(self) -> dict[str, list[TrajectoryState]]:
        """Live trajectories by the model their latest call was for."""
        out: dict[str, list[TrajectoryState]] = {}
        for st in self.live.values():
            if st.last_model is not None:
                out.setdefault(st.last_model, []).append(st)
        return out

    def get(self, trajectory_id: str) -> TrajectoryState | None:
        return self._states.get(trajectory_id)

    def touch(self, trajectory_id: str, group_id: str | None, now: float) -> TrajectoryState:
        """The trajectory's state, created on first sight.

        A call on a finished trajectory opens its next *attempt*: RL trainers reuse ids
        such as ``<prompt>-<sample>`` across steps, so the id names a slot, and each step's
        run of it is recorded (and exported) as its own attempt. Calls still in flight in
        the finished attempt keep their own state object and are recorded under it.
        """
        state = self._states.get(trajectory_id)
        if state is not None and state.aborted is not None:
            raise TrajectoryAborted(
                f"trajectory {trajectory_id!r} attempt {state.attempt} was aborted "
                f"({state.aborted}); the trainer runs it again after POST "
                f"/trajectories/{trajectory_id}/restart", param="trajectory_id")
        if state is None or state.finished_at is not None:
            attempt = 0 if state is None else state.attempt + 1
            group = group_id or (state.group_id if state is not None else None)
            return self.adopt(TrajectoryState(trajectory_id, group, created_at=now,
                                              attempt=attempt))
        self._states.move_to_end(trajectory_id)
        if group_id and not state.group_id:
            self._set_group(state, group_id)
        return state

    @_changes_view
    def _set_group(self, state: TrajectoryState, group_id: str) -> None:
        state.group_id = group_id
        self._join_group(state)

    @_changes_view
    def describe(self, state: TrajectoryState, *, prompt_id: str, model: str,
                 auto: bool) -> None:
        """What the first call of an attempt says of it: its task prompt's identity, the
        model, and whether it was untagged (a one-call trajectory)."""
        state.prompt_id = prompt_id
        state.model = model
        state.auto = auto

    @_changes_view
    def prefer(self, state: TrajectoryState, backend_id: str) -> None:
        """Send the trajectory's next call to ``backend_id`` (a migration whose prefix
        cache was prewarmed there)."""
        state.preferred_backend = backend_id

    def adopt(self, state: TrajectoryState) -> TrajectoryState:
        """Install ``state`` as the live state of its id (a new attempt, or one restored
        from the store after a restart); returns it."""
        self._states[state.id] = state
        self._states.move_to_end(state.id)
        self._retired.pop(state.id, None)
        if state.finished_at is None:
            self.live[state.id] = state
        else:
            self.live.pop(state.id, None)
            self._retired[state.id] = None
        self._join_group(state)
        self._evict()
        return state

    def _join_group(self, state: TrajectoryState) -> None:
        if state.group_id is not None:
            self.groups.setdefault(state.group_id, GroupState()).join(state.id)

    def _evict(self) -> None:
        while len(self._states) > self._capacity:
            victim = next(
                (k for k, s in self._states.items() if not s.in_flight and not s.queued), None
            )
            if victim is None:
                return
            self._forget(victim)

    def _retire(self, state: TrajectoryState) -> None:
        self.live.pop(state.id, None)
        self._retired[state.id] = None
        self._retired.move_to_end(state.id)
        while len(self._retired) > self._retain:
            victim, _ = self._retired.popitem(last=False)
            old = self._states.get(victim)
            if old is not None and not old.in_flight and not old.queued:
                self._forget(victim)

    def expire(self, idle_since: float) -> list[str]:
        """Forget the unfinished trajectories with no call queued or running and none
        ended (without one: none started) after ``idle_since``; returns their ids. A
        later call of one restores it from the store (gateway/trajectories/expiry.py)."""
        gone = [tid for tid, s in self.live.items() if not s.in_flight and not s.queued
                and (s.created_at if s.last_call_end is None else s.last_call_end) < idle_since]
        for tid in gone:
            self._forget(tid)
        return gone

    def _forget(self, victim: str) -> None:
        gone = self._states.pop(victim)
        self.live.pop(victim, None)
        self._retired.pop(victim, None)
        if gone.group_id is not None and (group := self.groups.get(gone.group_id)) is not None:
            group.leave(victim)
            if not group.members:
                del self.groups[gone.group_id]

    @_changes_view
    def call_arrived(
        self, state: TrajectoryState, outcomes: list[ToolOutcome], now: float
    ) -> int:
        """Register a new call; returns its provisional number within the attempt (the
        ``seq`` it gets if the calls before it are recorded first), for views and logs.
        Its stored ``seq`` is given when its record is made (:meth:`record_seq`)."""
        if state.last_call_end is not None and not state.in_flight and not state.queued:
            state.tool_time_s += max(0.0, now - state.last_call_end)
            state.add_segment(2, state.last_call_end, now)
        state.outcomes.extend(outcomes)
        state.queued += 1
        state.turns += 1
        return state.recorded + state.queued + state.in_flight - 1

    @staticmethod
    def record_seq(state: TrajectoryState) -> int:
        """The ``seq`` of the call being recorded now in ``state``'s attempt.

        Numbers are given in the order calls are recorded, which is the order they were
        placed in the tree (``call_finished``): a call that never reached a backend (the
        client left while it was queued, it was refused) takes none, so the recorded calls
        of an attempt are numbered 0, 1, 2, ... without gaps or repeats, and replaying them
        in ``seq`` order rebuilds the tree they were placed in."""
        seq = state.recorded
        state.recorded += 1
        return seq

    @_changes_view
    def call_dispatched(
        self, state: TrajectoryState, backend_id: str, queued_s: float
    ) -> None:
        state.queued -= 1
        state.in_flight += 1
        state.queue_time_s += queued_s
        state.last_queue_s = queued_s
        state.backend_id = backend_id
        state.preferred_backend = None

    @_changes_view
    def call_requeued(self, state: TrajectoryState) -> None:
        """A dispatched call goes back to the queue (its backend failed before answering)."""
        state.in_flight -= 1
        state.queued += 1

    @_changes_view
    def call_abandoned(self, state: TrajectoryState) -> None:
        """A call that never reached a backend (rejected, client left while queued)."""
        state.queued -= 1

    @_changes_view
    def call_finished(
        self,
        state: TrajectoryState,
        *,
        now: float,
        llm_s: float,
        prompt: Sequence[int] | None,
        completion: Sequence[int],
        ok: bool,
        turn: TurnFacts | None = None,
    ) -> Placement | None:
        """Account a finished call; returns where its prompt sits in the trajectory's tree
        when token ids were captured."""
        state.in_flight -= 1
        state.last_call_end = now
        state.llm_time_s += llm_s
        state.add_segment(0, now - llm_s - state.last_queue_s, now - llm_s)
        state.add_segment(1, now - llm_s, now)
        done = state.auto and not state.in_flight and not state.queued
        if done:
            self._retire(state)
        placed = self._place(state, prompt, completion, ok=ok, turn=turn)
        if done:  # one call, never continued: its tree is not needed again
            state.final_context = len(state.sequence)
            state.tree = Tree()
        return placed

    def _place(self, state: TrajectoryState, prompt: Sequence[int] | None,
               completion: Sequence[int], *, ok: bool, turn: TurnFacts | None
               ) -> Placement | None:
        if not ok:
            state.calls_failed += 1
            return None
        state.calls_done += 1
        state.completion_tokens += len(completion)
        state.last_completion_tokens = len(completion)
        if prompt is None:
            return None
        state.prompt_tokens += len(prompt)
        facts = turn or TurnFacts()
        placed = state.tree.place(prompt, completion, expected=facts.expected,
                                  digests=facts.digests, said=facts.said, routes=facts.routes,
                                  model=facts.model)
        if placed.mismatch_pos is not None:
            state.mismatches += 1
        return placed

    def finish(self, trajectory_id: str, reward: float | None, now: float, *,
               aborted: str | None = None) -> None:
        """End the live attempt (with ``aborted``: the trainer cut it short, why; its
        calls are refused until :meth:`restart`, and its length teaches no policy)."""
        state = self._states.get(trajectory_id)
        if state is not None and state.finished_at is None:
            self._end_attempt(state, reward, now, aborted)

    @_changes_view
    def _end_attempt(self, state: TrajectoryState, reward: float | None, now: float,
                     aborted: str | None) -> None:
        state.finished_at = now
        state.reward = reward
        state.aborted = aborted
        state.final_context = len(state.sequence)
        state.tree = Tree()  # the store has it; the policies keep the length
        self._retire(state)
        self.finished_count += 1
        group = self.groups.get(state.group_id) if state.group_id else None
        if group is not None and aborted is None:
            group.member_finished(state.completion_tokens, state.calls_done)

    def restart(self, trajectory_id: str) -> int | None:
        """Lift an abort: the id's next call opens its next attempt. Returns that attempt's
        number, or None if the id is not aborted."""
        state = self._states.get(trajectory_id)
        if state is None or state.aborted is None:
            return None
        state.aborted = None
        return state.attempt + 1
