"""A relayout at a weight push: the moment a pool that never goes idle changes its layout.

Under ``async`` (and ``overprovisioned`` carrying groups across steps) trajectories run
through every step, so the scheduling policy's ``plan`` never finds the pool idle and
never relays it out. A weight push pauses every engine anyway: while they are paused and
hold the new weights, the weight-update job asks the policy's ``at_pause`` (``replay``:
the layout fastest for the trajectories finished since the last choice). A relayout it
returns is applied there:

1. the instances it retires take no call from now on (``DRAINING``, :func:`propose_at_push`);
2. the engines resume and the gate opens: every call the push aborted goes on token in
   (``gateway.proxy.continuation``), and one whose engine is retired goes back to the
   queue and on to wherever the scheduler places it (``gateway.proxy.lifecycle.move``);
3. then (:func:`apply_at_push`, not before: the resume still talks to the retired engines)
   the relayout job (``gateway.pool.manager``) drains the retired instances (what is left
   on them: streams frozen in place, which finish there), stops them and starts the new
   ones on the new weights; queued calls wait for them as for any capacity on its way.

Only for ``abort-and-continue`` pushes of weights on a path (``reload``: an engine started
now can load them; pushed weights have no path to start from) on a managed pool.
"""

from __future__ import annotations

import logging
from typing import Any

from backends.base import ServerState
from gateway.policies.base import Relayout
from gateway.pool.jobs import Job
from gateway.runtime import Runtime, apply_relayout

log = logging.getLogger(__name__)


def propose_at_push(rt: Runtime, engine_mode: str, method: str) -> Relayout | None:
    """While the engines are paused with the new weights: the policy's relayout, if it
    has one that changes the layout; the instances it retires take no call from now on,
    so the calls the push aborted go on elsewhere once the gate opens."""
    pool = rt.pool
    scheduler = rt.dispatcher.scheduler
    hook = getattr(scheduler.policy, "at_pause", None)
    if (pool is None or pool.static or hook is None or method != "reload"
            or engine_mode != "abort-and-continue"):
        return None
    snap = scheduler.snapshot()
    try:
        change: Relayout | None = hook(snap)
    except Exception:  # a planner bug must not fail the push
        log.exception("policy %s failed to plan at the weight push", scheduler.policy.name)
        return None
    if change is None or not change.changes(snap) or \
            not set(change.retire) <= set(pool.instances):
        return None
    for iid in change.retire:
        inst = pool.instances[iid]
        if inst.state is ServerState.READY:
            inst.set_state(ServerState.DRAINING)
    return change


def apply_at_push(rt: Runtime, job: Job, change: Relayout) -> None:
    """After the engines resumed: the relayout job that drains, stops and replaces the
    retired instances (named on the weight-update job's ``plan.relayout``); if the pool
    refuses it, the retired instances serve again."""
    note: dict[str, Any] = {"retire": list(change.retire), "launch": list(change.launch),
                            "reason": change.reason}
    relayout, outcome = apply_relayout(rt, change, at_push=True)
    if relayout is not None:
        job.plan["relayout"] = {**note, "job": relayout.id}
        rt.dispatcher.scheduler.relayouts += 1
        return
    job.plan["relayout"] = {**note, "refused": outcome}
    assert rt.pool is not None
    for iid in change.retire:
        inst = rt.pool.instances.get(iid)
        if inst is not None and inst.state is ServerState.DRAINING:
            inst.set_state(ServerState.READY)
