"""Read-only policy views over the gateway's live state (the snapshot a policy reads).

Views are built lazily and cached on the tracker's state objects until they change, so
a ``schedule`` over hundreds of live trajectories costs a dict lookup per trajectory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from backends.base import ServerState
from gateway.dispatch.backends import Backend
from gateway.policies.base import (
    GroupView,
    InstanceState,
    InstanceView,
    TrajectoryView,
)
from gateway.trajectories.state import GroupState, TrajectoryState
from gateway.trajectories.tracker import Tracker


def instance_view(b: Backend, cap_per_gpu: int, kv_usage: float | None = None) -> InstanceView:
    gpus = len(b.gpus) or (b.tp or 1)
    if b.routable:
        state = InstanceState.UP
    elif b.state is ServerState.DRAINING:
        state = InstanceState.DRAINING
    else:
        state = InstanceState.STARTING
    return InstanceView(b.id, b.tp or 1, gpus, state, b.in_flight, cap_per_gpu * gpus,
                        kv_usage or 0.0, b.served)


def trajectory_view(st: TrajectoryState) -> TrajectoryView:
    if st.view is not None:
        return st.view
    view = TrajectoryView(
        id=st.id, group_id=st.group_id or st.id, prompt_id=st.prompt_id or st.id,
        started_at=st.created_at, turns=st.calls_done, context_tokens=st.context_tokens,
        generated_tokens=st.completion_tokens, last_output_tokens=st.last_completion_tokens,
        outcomes=tuple(o.state for o in st.outcomes), llm_time_s=st.llm_time_s,
        tool_time_s=st.tool_time_s, queue_time_s=st.queue_time_s,
        instance=st.preferred_backend or st.backend_id, phase=st.phase,
    )
    st.view = view
    return view


def group_view(group_id: str, g: GroupState) -> GroupView:
    if g.view is not None:
        return g.view
    view = GroupView(group_id, tuple(g.members), tuple(g.finished_lengths),
                     tuple(g.finished_turns))
    g.view = view
    return view


class LiveTrajectories(Mapping[str, TrajectoryView]):
    def __init__(self, tracker: Tracker) -> None:
        self._live = tracker.live

    def __getitem__(self, key: str) -> TrajectoryView:
        return trajectory_view(self._live[key])

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._live))

    def __len__(self) -> int:
        return len(self._live)


class Groups(Mapping[str, GroupView]):
    def __init__(self, tracker: Tracker) -> None:
        self._groups = tracker.groups

    def __getitem__(self, key: str) -> GroupView:
        return group_view(key, self._groups[key])

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._groups))

    def __len__(self) -> int:
        return len(self._groups)
