"""Calls waiting in the scheduler's queue, and the ways a queued call fails without being
placed (``gateway.dispatch.scheduler``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Set
from dataclasses import dataclass

from gateway.dispatch.backends import Backend
from gateway.errors import (
    GatewayError,
    NoBackendAvailable,
    SchedulingFailed,
    TrajectoryAborted,
    TrajectoryFinished,
)
from gateway.policies.base import PendingCall
from gateway.trajectories.state import TrajectoryState

Placed = tuple[Backend, int]


@dataclass(slots=True)
class Waiter:
    call: PendingCall
    model: str  # the served model whose engines run it
    exclude: frozenset[str]
    future: asyncio.Future[Placed]
    #: the model the call is for: ``model`` itself or a LoRA family of it; the unit of
    #: the fair share of ``model``'s slots (``gateway.dispatch.shares``)
    family: str = ""


def expire_unroutable(model: str, waiters: Iterable[Waiter], deadline: float) -> None:
    """Every backend of ``model`` went away while these calls waited: fail the ones
    enqueued at or before ``deadline`` (503, as if they had arrived now), so a pool that
    lost its last backend never holds calls for the whole queue timeout. The periodic
    tick brings this round."""
    for w in waiters:
        if w.call.enqueued_at <= deadline and not w.future.done():
            w.future.set_exception(NoBackendAvailable(
                f"no healthy backend can serve model {model!r}: every backend went "
                f"away while this call waited in the gateway queue"))


def gone_error(trajectory_id: str, state: TrajectoryState | None) -> GatewayError:
    """What a queued call whose trajectory left the live set is answered: the 409 its
    next call would get when its attempt ended while it waited before the queue (aborted
    by the trainer or the staleness bound during a weight push's pause, or finished);
    else the trajectory was evicted under it, a scheduling fault (500)."""
    if state is not None and state.aborted is not None:
        return TrajectoryAborted(
            f"trajectory {state.id!r} attempt {state.attempt} was aborted while this call "
            f"waited ({state.aborted}); the trainer runs it again after POST "
            f"/trajectories/{state.id}/restart", param="trajectory_id")
    if state is not None and state.finished_at is not None:
        return TrajectoryFinished(
            f"trajectory {state.id!r} was finished while this call waited; a new call on "
            "the id opens its next attempt")
    return SchedulingFailed(f"trajectory {trajectory_id!r} is no longer live in the "
                            "gateway (evicted while this call waited); retry the call")


def fail_ended(waiters: Iterable[Waiter], trajectory_ids: Set[str]) -> int:
    """Their attempts were finished: calls of them still queued fail with 409 (they
    belong to the finished attempt; the next call on the id opens a new one), in one
    pass over the queue. Returns how many."""
    failed = 0
    for w in waiters:
        tid = w.call.trajectory_id
        if tid in trajectory_ids and not w.future.done():
            w.future.set_exception(TrajectoryFinished(
                f"trajectory {tid!r} was finished while this call waited in "
                "the queue; a new call on the id opens its next attempt"))
            failed += 1
    return failed
