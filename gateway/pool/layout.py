"""Pool layout arithmetic: GPU inventory, placing instances on GPUs, diffing layouts.

Pure functions (no I/O), so a reconfiguration plan can be checked before anything is
stopped and tested without servers. The identity of an instance is its *placement*
(node, GPUs, TP, model, extra arguments): applying a layout keeps every instance whose
placement is unchanged and restarts only the others, because a running vLLM cannot
change its TP degree or GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import InstanceSpec

GpuSlot = tuple[str, int]  # (node, GPU id)


class LayoutError(ValueError):
    """A layout or resize request that cannot be placed on the GPUs available."""


@dataclass(frozen=True, slots=True)
class InstanceRequest:
    """One instance of a requested layout; ``gpus=None`` lets the planner pick them."""

    tp: int = 1
    gpus: tuple[int, ...] | None = None
    node: str | None = None
    id: str | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    keep: tuple[InstanceSpec, ...]
    stop: tuple[InstanceSpec, ...]
    start: tuple[InstanceSpec, ...]

    def describe(self) -> dict[str, list[str]]:
        return {k: [s.id for s in getattr(self, k)] for k in ("keep", "stop", "start")}


def placement_key(spec: InstanceSpec) -> tuple[object, ...]:
    return (spec.node, spec.gpus, spec.tp, spec.model, spec.extra_args)


def default_id(node: str, gpus: Sequence[int], tp: int, single_node: bool) -> str:
    """``tp2-g0-1`` (one node) or ``n1-tp2-g0-1``: readable in traces and on the page."""
    base = f"tp{tp}-g" + "-".join(map(str, gpus))
    return base if single_node else f"{node}-{base}"


def slots_of(spec: InstanceSpec) -> set[GpuSlot]:
    return {(spec.node, g) for g in spec.gpus}


def diff(current: Iterable[InstanceSpec], target: Iterable[InstanceSpec]) -> Plan:
    """Which instances to keep (same placement), stop and start."""
    cur, tgt = list(current), list(target)
    wanted = {placement_key(s) for s in tgt}
    have = {placement_key(s): s for s in cur}
    keep = tuple(s for s in cur if placement_key(s) in wanted)
    stop = tuple(s for s in cur if placement_key(s) not in wanted)
    start = tuple(s for s in tgt if placement_key(s) not in have)
    return Plan(keep, stop, start)


def place(
    requests: Sequence[InstanceRequest],
    active: Sequence[GpuSlot],
    model: str,
    current: Sequence[InstanceSpec] = (),
) -> list[InstanceSpec]:
    """Turn ``requests`` into specs on the ``active`` GPUs (in inventory order).

    Explicit GPUs are checked; the others get, in order of preference, the placement of a
    current instance with the same TP (so it keeps serving), else the first ``tp`` free
    GPUs of one node.
    """
    nodes = list(dict.fromkeys(n for n, _ in active))
    single = len(nodes) <= 1
    free = list(active)
    specs: list[InstanceSpec] = []
    for req in sorted(requests, key=lambda r: r.gpus is None):  # explicit ones first
        node, gpus = _choose(req, free, nodes, current)
        for g in gpus:
            free.remove((node, g))
        spec_id = req.id or default_id(node, gpus, req.tp, single)
        specs.append(InstanceSpec(id=spec_id, model=model, tp=req.tp, gpus=gpus, node=node,
                                  extra_args=req.extra_args))
    _check_unique_ids(specs)
    return specs


def _choose(
    req: InstanceRequest, free: list[GpuSlot], nodes: list[str], current: Sequence[InstanceSpec]
) -> tuple[str, tuple[int, ...]]:
    if req.tp < 1:
        raise LayoutError(f"tp must be >= 1, got {req.tp}")
    if req.gpus is not None:
        node = req.node or (nodes[0] if nodes else "local")
        if len(req.gpus) != req.tp:
            raise LayoutError(f"tp={req.tp} needs {req.tp} GPUs, got {list(req.gpus)}")
        missing = [g for g in req.gpus if (node, g) not in free]
        if missing:
            raise LayoutError(f"GPUs {missing} on node {node!r} are not available "
                              "(not in the active inventory, or used twice)")
        return node, tuple(req.gpus)
    for spec in current:  # reuse a running instance's placement where possible
        if (spec.tp == req.tp and req.node in (None, spec.node) and spec.gpus
                and slots_of(spec) <= set(free)):
            return spec.node, spec.gpus
    for node in [req.node] if req.node else nodes:
        on_node = [g for n, g in free if n == node]
        if len(on_node) >= req.tp:
            return node, tuple(on_node[: req.tp])
    raise LayoutError(f"no node has {req.tp} free GPUs for a TP{req.tp} instance "
                      f"(free: {_fmt(free)})")


def _check_unique_ids(specs: Sequence[InstanceSpec]) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.id in seen:
            raise LayoutError(f"instance id {s.id!r} appears twice")
        seen.add(s.id)


def select_gpus(inventory: Sequence[GpuSlot], current: Sequence[InstanceSpec],
                count: int) -> list[GpuSlot]:
    """``count`` GPUs of the inventory to keep for rollout, disrupting the fewest instances.

    Whole current instances are kept in layout order while they fit; the rest of the
    budget is filled with GPUs in inventory order.
    """
    if not 0 <= count <= len(inventory):
        raise LayoutError(f"gpus must be between 0 and {len(inventory)}, got {count}")
    chosen: set[GpuSlot] = set()
    for spec in current:
        need = slots_of(spec) - chosen
        if need and len(chosen) + len(need) <= count and need <= set(inventory):
            chosen |= need
    for slot in inventory:
        if len(chosen) >= count:
            break
        chosen.add(slot)
    return [s for s in inventory if s in chosen]


def resize(current: Sequence[InstanceSpec], active: Sequence[GpuSlot],
           default_tp: int) -> list[InstanceRequest]:
    """The layout after the active GPUs changed: current instances that still fit stay;
    GPUs that became free get instances of ``default_tp`` (TP1 for a remainder)."""
    allowed = set(active)
    requests = [InstanceRequest(tp=s.tp, gpus=s.gpus, node=s.node, id=s.id,
                                extra_args=s.extra_args)
                for s in current if s.gpus and slots_of(s) <= allowed]
    used = {slot for s in current if s.gpus and slots_of(s) <= allowed for slot in slots_of(s)}
    free = [slot for slot in active if slot not in used]
    for node in dict.fromkeys(n for n, _ in free):
        gpus = [g for n, g in free if n == node]
        while gpus:
            tp = default_tp if len(gpus) >= default_tp else 1
            requests.append(InstanceRequest(tp=tp, gpus=tuple(gpus[:tp]), node=node))
            gpus = gpus[tp:]
    return requests


def _fmt(slots: Iterable[GpuSlot]) -> str:
    return ", ".join(f"{n}:{g}" for n, g in slots) or "none"


def parse_slot(value: int | str) -> GpuSlot:
    """A GPU as the admin API names it: ``3`` (this node) or ``"node:3"``."""
    if isinstance(value, int):
        return ("local", value)
    node, _, gpu = value.rpartition(":")
    if not gpu.isdigit():
        raise LayoutError(f"a GPU is an id or 'node:id', not {value!r}")
    return (node or "local", int(gpu))


def slot_json(slot: GpuSlot) -> int | str:
    """The inverse of :func:`parse_slot`."""
    return slot[1] if slot[0] == "local" else f"{slot[0]}:{slot[1]}"


def request_of(spec: InstanceSpec) -> InstanceRequest:
    """The request that places ``spec`` again where it is."""
    return InstanceRequest(tp=spec.tp, gpus=spec.gpus, node=spec.node, id=spec.id,
                           extra_args=spec.extra_args)


def request_json(r: InstanceRequest) -> dict[str, Any]:
    """``r`` as a job's request records it."""
    return {"id": r.id, "tp": r.tp, "node": r.node, "extra_args": list(r.extra_args),
            "gpus": None if r.gpus is None else list(r.gpus)}
