"""A relayout at a weight push: the moment a pool that never goes idle changes its layout.

Under ``async`` (and ``overprovisioned`` carrying groups across steps) trajectories run
through every step, so the scheduling policy's ``plan`` never finds the pool idle and
never relays it out. A weight push pauses every engine anyway: while they are paused and
hold the new weights, the weight-update job asks the policy's ``at_pause`` (``replay``:
the layout fastest for the trajectories finished since the last choice). A relayout it
returns is applied there:

1. the instances it retires take no call from now on (``DRAINING``);
2. the engines resume and the gate opens: every call the push aborted goes on token in
   (``gateway.proxy.continuation``), and one whose engine is retired goes back to the
   queue and on to wherever the scheduler places it (``gateway.proxy.lifecycle.move``);
3. the relayout job (``gateway.pool.manager``) drains the retired instances (what is left
   on them: streams frozen in place, which finish there), stops them and starts the new
   ones on the new weights; queued calls wait for them as for any capacity on its way.

Only for ``abort-and-continue`` pushes of weights on a path (``reload``: an engine started
now can load them; pushed weights have no path to start from) on a managed pool.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from backends.base import ServerState
from gateway.pool.jobs import Job
from gateway.pool.layout import LayoutError
from gateway.runtime import Runtime

log = logging.getLogger(__name__)


def relayout_at_push(rt: Runtime, job: Job, engine_mode: str, method: str) -> None:
    """While the engines are paused with the new weights: the policy's relayout, if any,
    started (its instances retired now, its job run once the push resumes). What became
    of it is on the weight-update job's plan (``relayout``)."""
    pool = rt.pool
    hook = getattr(rt.dispatcher.scheduler.policy, "at_pause", None)
    if (pool is None or pool.static or hook is None or method != "reload"
            or engine_mode != "abort-and-continue"):
        return
    scheduler = rt.dispatcher.scheduler
    snap = scheduler.snapshot()
    try:
        change = hook(snap)
    except Exception:  # a planner bug must not fail the push
        log.exception("policy %s failed to plan at the weight push", scheduler.policy.name)
        return
    if change is None or not change.changes(snap):
        return
    note: dict[str, Any] = {"retire": list(change.retire), "launch": list(change.launch),
                            "reason": change.reason}
    relayout: Job | None = None
    try:
        relayout = pool.relayout(change.retire, change.launch, change.reason, at_push=True)
        outcome = f"applying as job {relayout.id}"
        job.plan["relayout"] = {**note, "job": relayout.id}
    except LayoutError as exc:
        outcome = f"not applied: {exc}"
        job.plan["relayout"] = {**note, "refused": str(exc)}
    rt.relayouts.record(time.time(), change.retire, change.launch, change.reason,
                        job=relayout, refused=None if relayout is not None else outcome)
    rt.events.emit("relayout", f"at the weight push, policy proposes retiring "
                   f"{list(change.retire)} for TP {list(change.launch)} ({change.reason}); "
                   f"{outcome}", retire=list(change.retire), launch=list(change.launch))
    if relayout is None:
        return
    for iid in change.retire:  # before the gate opens: no call goes back to them
        inst = pool.instances.get(iid)
        if inst is not None and inst.state is ServerState.READY:
            inst.set_state(ServerState.DRAINING)
    scheduler.relayouts += 1
