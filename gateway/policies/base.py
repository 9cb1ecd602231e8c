"""Types shared by every policy: read-only views of calls and backends.

Policies are pure: they take these views and ``now`` and return a decision. They never
see ``max_tokens``, ``ignore_eos`` or any workload hint (the benchmark forces lengths
with those), only what a real gateway observes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class BackendView:
    id: str
    tp: int
    in_flight: int
    served: int = 0


@dataclass(frozen=True, slots=True)
class CallView:
    """What a policy may know about a call when placing it."""

    trajectory_id: str
    group_id: str | None
    seq: int
    context_tokens: int
    previous_backend: str | None


class Placement(Protocol):
    name: str

    def choose(self, call: CallView, candidates: Sequence[BackendView], now: float) -> str:
        """Pick one of ``candidates`` (never empty) for ``call``; return its id."""
        ...


class LeastLoaded:
    """Fewest in-flight calls first; ties to the one that served least (spreads load).

    The per-call baseline of SGLang's router and slime: blind to trajectories.
    """

    name = "least-loaded"

    def choose(self, call: CallView, candidates: Sequence[BackendView], now: float) -> str:
        return min(candidates, key=lambda b: (b.in_flight, b.served, b.id)).id
