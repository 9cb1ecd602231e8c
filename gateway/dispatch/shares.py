"""Fair shares of a base model's free slots among the policies that wait for them.

Several policies (a base model and LoRA families of it, :mod:`gateway.adapters`) share one
base's engines. When their queued calls outnumber the free slots, one policy's burst
(a trainer starting a large step) must not hold every slot while another's trajectories
wait: the free slots are split by weighted max-min fairness over calls in flight
(water-filling, as a fair-share scheduler splits a resource): each next slot goes to the
waiting policy with the fewest calls running plus granted so far per unit of weight, until
its demand is met. A policy that waits for less than its share gets what it waits for; the
rest goes to the others, so no slot is left idle while anyone waits.

Pure: no I/O, no clock. The scheduler (``gateway.dispatch.scheduler``) runs one policy
pass per policy with its share as a bound on placements, then a last pass over whoever
is left, so the split never leaves a slot empty that a call could take.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping


def fair_shares(free: int, waiting: Mapping[str, int], running: Mapping[str, int],
                weights: Mapping[str, float] | None = None) -> dict[str, int]:
    """How many of ``free`` slots each policy in ``waiting`` (calls queued per policy) may
    take now, given its calls ``running`` and its weight (default 1; a weight must be
    positive). Sums to ``min(free, sum(waiting))``; ties go to the policy named first."""
    weights = weights or {}
    share = dict.fromkeys(waiting, 0)
    heap = []
    for order, (p, n) in enumerate(waiting.items()):
        w = weights.get(p, 1.0)
        if w <= 0:
            raise ValueError(f"policy {p!r} has weight {w}; weights must be positive")
        if n > 0:
            heap.append((running.get(p, 0) / w, order, p, w))
    heapq.heapify(heap)
    for _ in range(max(0, free)):
        if not heap:
            break
        _, order, p, w = heapq.heappop(heap)
        share[p] += 1
        if share[p] < waiting[p]:
            heapq.heappush(heap, ((running.get(p, 0) + share[p]) / w, order, p, w))
    return share
