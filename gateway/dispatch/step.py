"""One scheduling pass, pure: the rule the gateway and the simulator both run.

``schedule_pass(policy, snap, queued, live)`` decides, for the instances in ``snap`` (the
ones a call may go to now, each with its ``running`` count and ``cap``):

1. A retry (a call with backends to ``exclude``, requeued after an upstream failure) goes
   to the least loaded instance it has not tried that has a free slot, with priority 0;
   the policy never sees it. With no such instance it waits for a later pass.
2. A call whose trajectory is gone from ``live`` (finished or evicted while it waited)
   fails (``stale``): it is never held.
3. The other calls go to the policy as one batch, against a snapshot that counts the
   retries just placed. When the policy raises, the calls it raises on alone fail
   (``policy``, with the exception) and the rest are placed (``isolation.isolate``).
   With no free slot anywhere the policy is not asked: nothing could be placed.
4. Placements beyond an instance's free slots, or to an instance not in ``snap``, or of a
   call not queued, are dropped: the cap holds whatever the policy answers.

A pass whose inputs equal the previous pass's (``last``: same queue, same free slots, same
``revision``) is skipped and reports ``changed=False``. ``revision`` is the driver's count
of changes the step cannot see (trajectory views, groups, the policy's own state after
``observe``/``plan``); a driver that wants every pass run passes ``last=None``.

No I/O, no awaits, no clock: time is ``snap.now``. The import contract ``pure-step`` in
``pyproject.toml`` keeps it so.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gateway.dispatch.isolation import isolate
from gateway.policies.base import Dispatch, InstanceView, PendingCall, Policy, Snapshot

STALE, POLICY = "stale", "policy"


@dataclass(frozen=True, slots=True)
class Queued:
    """A call in the queue; ``exclude`` names the backends a retry already tried."""

    call: PendingCall
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Failure:
    """A call this pass fails: ``reason`` is ``stale`` or ``policy`` (then ``error`` is what
    the policy raised on it alone)."""

    call: PendingCall
    reason: str
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class PassKey:
    """What a pass read, to tell an identical next pass (compare with ``==``)."""

    revision: Hashable
    queue: frozenset[tuple[str, frozenset[str]]]
    free: tuple[tuple[str, int], ...]


@dataclass(slots=True)
class Pass:
    """The outcome of one pass: placements in order, failures, and whether it ran."""

    key: PassKey
    changed: bool = True
    placed: list[Dispatch] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    isolated: bool = False  # a policy fault was isolated: run the next pass soon, batched


def schedule_pass(policy: Policy, snap: Snapshot, queued: Sequence[Queued],
                  live: Container[str], *, revision: Hashable = None,
                  last: PassKey | None = None, free: Mapping[str, int] | None = None) -> Pass:
    """Run one pass (see the module docstring); the caller applies ``placed`` and
    ``failed`` in order. ``free`` is each instance's free slots where the driver knows
    better than ``snap`` (default: the snapshot's)."""
    free = dict(free) if free is not None else {i.id: i.free_slots for i in snap.instances}
    out = Pass(PassKey(revision, frozenset((q.call.key, q.exclude) for q in queued),
                       tuple(sorted(free.items()))))
    if last is not None and out.key == last:
        out.changed = False
        return out
    load = {i.id: i.running for i in snap.instances}
    plain: list[PendingCall] = []
    for q in queued:
        if q.exclude:
            _retry(q, free, load, out.placed)
        elif q.call.trajectory_id in live:
            plain.append(q.call)
        else:
            out.failed.append(Failure(q.call, STALE))
    if not plain or not any(n > 0 for n in free.values()):
        return out
    if out.placed:  # the policy sees the retries just placed
        snap = replace(snap, instances=tuple(_loaded(i, load) for i in snap.instances))
    try:
        answer = policy.schedule(snap, plain)
    except Exception:
        faults: list[Failure] = []
        answer = isolate(policy, snap, plain,
                         lambda call, exc: faults.append(Failure(call, POLICY, exc)))
        out.failed.extend(faults)
        out.isolated = bool(faults)
    keys = {c.key for c in plain} - {f.call.key for f in out.failed}
    for d in answer:
        if d.key in keys and free.get(d.instance, 0) > 0:
            keys.discard(d.key)
            free[d.instance] -= 1
            out.placed.append(d)
    return out


def _retry(q: Queued, free: dict[str, int], load: dict[str, int],
           placed: list[Dispatch]) -> None:
    """A retry goes to the least loaded instance it has not tried (ties: by id)."""
    options = [i for i, n in free.items() if n > 0 and i not in q.exclude and i in load]
    if not options:
        return
    target = min(options, key=lambda i: (load[i], i))
    free[target] -= 1
    load[target] += 1
    placed.append(Dispatch(q.call.key, target, 0))


def _loaded(inst: InstanceView, load: dict[str, int]) -> InstanceView:
    return inst if load[inst.id] == inst.running else replace(inst, running=load[inst.id])
