"""Handing GPUs between managed pools: what moves an instance from one shard to another.

A shard of a sharded gateway (:mod:`gateway.shards`) owns a block of the pool's GPUs. To
even out a skewed batch the front moves an *instance* between shards, never a trajectory
(its prefix cache lives on its instance):

1. :func:`release` on the giving shard: the instance is drained (no new calls, calls in
   flight finish) and stopped by the pool's own job, and its GPUs leave this pool's
   inventory at once, so no resize or relayout of this pool can place anything on them
   meanwhile. The job's ``request`` names the GPUs; they are free once the job succeeded.
2. :func:`adopt` on the taking shard: the GPUs join its inventory and one instance of the
   same TP starts on them, on the current weights, like any other start of the pool.

If the taking shard refuses (or cannot be reached), the front gives the GPUs back to the
giving shard with :func:`adopt`, so GPUs are never lost between the two.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.base import ServerState
from gateway.pool.jobs import Job
from gateway.pool.layout import (
    GpuSlot,
    InstanceRequest,
    LayoutError,
    parse_slot,
    place,
    request_of,
    slot_json,
    slots_of,
)
from gateway.pool.manager import PoolManager


class NoSuchInstance(LayoutError):
    """The pool has no instance of that id."""


class HandoverConflict(LayoutError):
    """The request is well formed but the pool's state refuses it (GPUs already held, the
    last serving instance)."""


def release(pool: PoolManager, instance_id: str) -> Job:
    """Drain and stop ``instance_id`` and take its GPUs out of the inventory; the job.

    LayoutError if the pool has no such instance, it holds no GPUs, or it is the pool's
    last instance (a shard keeps one engine to serve the trajectories hashed to it)."""
    if pool.static:
        raise LayoutError("a static pool holds no GPUs to release (move the backend instead)")
    spec = next((s for s in pool.planned if s.id == instance_id), None)
    if spec is None:
        raise NoSuchInstance(f"no instance {instance_id!r} in this pool "
                          f"(planned: {[s.id for s in pool.planned]})")
    if not spec.gpus:
        raise LayoutError(f"{instance_id!r} holds no GPUs")
    serving = [i for i in pool.instances.values()
               if i.state is ServerState.READY and i.spec.id != instance_id]
    if len(pool.planned) == 1 or not serving:
        raise HandoverConflict(f"{instance_id!r} is this pool's last instance (or its last "
                               "serving one): its trajectories would have no engine")
    gone = slots_of(spec)
    pool.inventory = [s for s in pool.inventory if s not in gone]
    pool.active = [s for s in pool.active if s not in gone]
    target = [s for s in pool.planned if s.id != instance_id]
    gpus = [slot_json(s) for s in sorted(gone)]
    return pool.submit("release", {"id": instance_id, "gpus": gpus, "tp": spec.tp}, target)


def adopt(pool: PoolManager, gpus: Sequence[int | str], tp: int | None = None,
          instance_id: str | None = None) -> Job:
    """Add ``gpus`` (``3`` or ``"node:3"``, all on one node) to the inventory and start one
    instance of ``tp`` (default: all of them) on them; the job. LayoutError if a GPU is
    already this pool's or they do not make one instance."""
    if pool.static:
        raise LayoutError("a static pool cannot start instances")
    slots: list[GpuSlot] = [parse_slot(g) for g in gpus]
    if not slots or len(set(slots)) != len(slots):
        raise LayoutError(f"give the GPUs to adopt, each once: {list(gpus)}")
    held = sorted(set(slots) & set(pool.inventory))
    if held:
        raise HandoverConflict(f"GPUs {[slot_json(s) for s in held]} are already this pool's")
    nodes = {n for n, _ in slots}
    if len(nodes) != 1:
        raise LayoutError(f"one instance runs on one node: {sorted(nodes)}")
    tp = tp or len(slots)
    if tp != len(slots):
        raise LayoutError(f"tp={tp} needs {tp} GPUs, got {len(slots)}")
    current = [request_of(s) for s in pool.planned]
    request = InstanceRequest(tp=tp, gpus=tuple(g for _, g in slots), node=nodes.pop(),
                              id=instance_id)
    target = place([*current, request], [*pool.active, *slots], pool.spec.model,
                   pool.planned)  # checked before anything changes
    pool.inventory = [*pool.inventory, *slots]
    pool.active = [*pool.active, *slots]
    return pool.submit("adopt", {"gpus": [slot_json(s) for s in slots], "tp": tp}, target)
