"""Calls waiting in the scheduler's queue, and the ways a queued call fails without being
placed (``gateway.dispatch.scheduler``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Set
from dataclasses import dataclass

from gateway.dispatch.backends import Backend
from gateway.errors import NoBackendAvailable, TrajectoryFinished
from gateway.policies.base import PendingCall

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
