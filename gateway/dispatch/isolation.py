"""Scheduling past a policy that raises: one bad entry must never stop the queue."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from gateway.policies.base import Dispatch, PendingCall, Policy, Snapshot

log = logging.getLogger(__name__)


def isolate(policy: Policy, snap: Snapshot, calls: Sequence[PendingCall],
            failed: Callable[[PendingCall, Exception], None]) -> list[Dispatch]:
    """The policy raised on ``calls`` as a batch: find the calls it raises on alone (each
    handed to ``failed``), then schedule the rest as one batch, in arrival order."""
    survivors: list[PendingCall] = []
    singles: list[Dispatch] = []
    for call in sorted(calls, key=lambda c: c.enqueued_at):
        try:
            singles.extend(policy.schedule(snap, [call]))
        except Exception as exc:
            failed(call, exc)
            continue
        survivors.append(call)
    if not survivors:
        return []
    try:
        return policy.schedule(snap, survivors)
    except Exception:  # it raises only on a combination: keep the one-call answers
        log.debug("policy %s raised on a batch but on none of its calls alone",
                  policy.name, exc_info=True)
    out: list[Dispatch] = []
    taken: dict[str, int] = {}
    for d in singles:  # each one-call batch saw every slot free: keep the pass honest
        if taken.get(d.instance, 0) < _free(snap, d.instance):
            taken[d.instance] = taken.get(d.instance, 0) + 1
            out.append(d)
    return out  # calls left over are placed by the next pass (a call end or a tick)


def _free(snap: Snapshot, instance: str) -> int:
    for i in snap.instances:
        if i.id == instance:
            return max(0, i.free_slots)
    return 0
