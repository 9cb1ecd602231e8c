"""The trainer cuts a trajectory short: abort its attempt, and the staleness bound.

Step modes past the synchronous barrier (docs/step-modes.md) stop trajectories the trainer
will not train on: the groups an over-provisioned step did not need, a short round's tail
in tail batching, a trajectory whose oldest token would be trained more weight versions
behind than the bound allows. :func:`abort_trajectory` does it in one step:

* the attempt is finished in the store with no reward and ``metadata.aborted`` (its calls
  stay recorded; group fetches leave it out), and in the tracker, which refuses its later
  calls with 409 ``trajectory_aborted`` (the harness stops there) until the trainer lifts
  the abort (``POST /trajectories/{id}/restart``: the next call opens a new attempt);
* its calls queued in the gateway fail with 409 ``trajectory_finished``;
* its calls generating on an engine are aborted there (``/abort_requests``), so the KV
  they hold is freed now: the client gets ``finish_reason: "abort"`` with the tokens made
  so far. An engine without that route lets them run to their end.

The staleness bound (``PUT /admin/staleness``): whenever the weight version changes, every
live trajectory that started (its first call arrived) on weights more than
``max_staleness`` versions behind the new ones is aborted, whether it has generated yet or
still waits in the queue, because no trainer step from now on could train it within
the bound. Versions must be integers for the bound to apply (``"3"``, not ``"step-3"``).
A trajectory that finished in time but waits to be trained is the trainer's to check
(:class:`gateway.client.StepRunner` does).
"""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import Conflict, NotFound
from gateway.live_calls import engine_ids
from gateway.pool import engines
from gateway.runtime import Runtime
from gateway.store import queries
from gateway.trajectories.state import TrajectoryState


async def abort_trajectory(rt: Runtime, trajectory_id: str, reason: str,
                           *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Abort the live attempt of ``trajectory_id`` (idempotent); what was done."""
    state = rt.tracker.get(trajectory_id) or await rt.restorer.restore(trajectory_id)
    if state is None:
        raise NotFound(f"no trajectory {trajectory_id!r}")
    if state.aborted is not None:
        return _answer(state, 0, [])
    if state.finished_at is not None:
        raise Conflict(f"trajectory {trajectory_id!r} attempt {state.attempt} is already "
                       "finished", param="trajectory_id")
    # its calls still queued fail now, before the store's write: a slot freed while the
    # write is awaited must not start one of them on an engine the abort would then miss
    rt.dispatcher.scheduler.trajectories_ended({trajectory_id})
    now = time.time()
    async with rt.sessionmaker() as session, session.begin():
        await queries.finish_trajectory(
            session, trajectory_id=trajectory_id, group_id=state.group_id, reward=None,
            metadata={"aborted": reason}, now=now, attempt=state.attempt)
    rt.tracker.finish(trajectory_id, None, now, aborted=reason)
    rt.dispatcher.scheduler.trajectory_finished(state)  # and any queued during the write
    calls = rt.live_calls.of(trajectory_id)
    errors = []
    for backend_id, ids in calls.items():
        backend = rt.registry.get(backend_id)
        if backend is None:
            continue
        err = await engines.abort_requests(rt.session, backend.url,
                                           [e for cid in ids for e in engine_ids(cid)],
                                           timeout_s)
        if err:
            errors.append(f"{backend_id}: {err}")
    rt.events.emit("trajectory", f"{trajectory_id} attempt {state.attempt} aborted: {reason}",
                   trajectory=trajectory_id, reason=reason)
    return _answer(state, sum(len(v) for v in calls.values()), errors)


def _answer(state: TrajectoryState, calls: int, errors: list[str]) -> dict[str, Any]:
    return {"id": state.id, "attempt": state.attempt, "reason": state.aborted,
            "aborted_calls": calls, "engine_errors": errors}


def _version(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def lag(rt: Runtime, state: TrajectoryState) -> tuple[str, str, int] | None:
    """The first model ``state`` called that its bound no longer admits: (model, the
    version it started on, the bound); None while every one is within its bound."""
    for model, started in state.first_versions.items():
        bound = rt.bound_for(model)
        current, first = _version(rt.version_of(model)), _version(started)
        if bound is not None and current is not None and first is not None \
                and current - first > bound:
            return model, started, bound
    return None


def stale(rt: Runtime) -> list[TrajectoryState]:
    """Live trajectories the bound no longer lets a trainer step take: each is judged
    per model it called, against that model's version and bound."""
    return [state for state in list(rt.tracker.live.values())
            if state.aborted is None and lag(rt, state) is not None]


async def enforce_staleness(rt: Runtime) -> list[str]:
    """Abort every trajectory past the bound (after a weight version change)."""
    done = []
    past = stale(rt)
    # every queued call of them fails, in one pass over the queue, before any abort frees
    # a slot; each abort fails again those that arrived while the aborts before it awaited
    if past:
        rt.dispatcher.scheduler.trajectories_ended({state.id for state in past})
    for state in past:
        model, started, bound = lag(rt, state) or ("", "", 0)
        reason = (f"staleness: it started on {model} weights {started}, the engines now "
                  f"serve {rt.version_of(model)}, bound {bound}")
        try:
            await abort_trajectory(rt, state.id, reason)
        except Conflict:  # finished meanwhile: nothing to cut
            continue
        done.append(state.id)
    return done
