"""Simulator-side state: instances (engines on GPUs) and trajectories (hidden + observed).

A :class:`Traj` holds the hidden :class:`~bench.workloads.TrajectorySpec` *and* what the
gateway observed; only :meth:`Traj.view` crosses into policy code, and it copies the
observed fields alone. Token streams are synthetic but consistent, so the engines'
prefix caches see real shared prefixes: a group's members share their prompt blocks,
and turn k+1's prompt extends turn k's prompt + completion token for token.

Also here: what a batch counts (:class:`SimStats`) and the snapshot's mapping of live
trajectories (:class:`LiveViews`), which builds views only when a policy reads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from backends.sim.engine import EngineCore
from backends.sim.kv_cache import ROOT_HASH, chain_hash
from bench.workloads import TrajectorySpec
from gateway.policies.base import InstanceState, InstanceView, Phase, TrajectoryView

#: Filler token values (small ints: shared objects, cheap lists); a prompt's header
#: block and a trajectory's first output token make every stream distinct.
BASE_LEN = 1 << 17
BASE = [(j * 7 + 3) % 200 + 1 for j in range(BASE_LEN)]


@dataclass(slots=True, eq=False)
class Instance:
    id: str
    tp: int
    engine: EngineCore
    cap: int
    state: InstanceState = InstanceState.UP
    running: int = 0  # gateway calls in the engine (prewarms not counted)
    served: int = 0
    busy: bool = False  # a step is in flight (its end is on the event heap)
    relayout: int | None = None  # id of the relayout draining this instance

    def view(self) -> InstanceView:
        return InstanceView(self.id, self.tp, self.tp, self.state, self.running, self.cap,
                            self.engine.kv_usage, self.served)


@dataclass(slots=True, eq=False)
class Traj:
    spec: TrajectorySpec
    index: int
    started_at: float = 0.0
    turn: int = 0  # index of the next (or running) call
    context: int = 0  # tokens of the last prompt + completion
    generated: int = 0
    outcomes: list[str] = field(default_factory=list)
    llm_s: float = 0.0
    tool_s: float = 0.0
    queue_s: float = 0.0
    instance: str | None = None
    phase: Phase = Phase.QUEUED
    hashes: list[int] = field(default_factory=list)
    dispatched_at: float = 0.0
    partial: int = 0  # tokens of the running call generated before a relayout moved it
    request: str = ""  # the engine request of the running call
    enqueued_at: float = 0.0
    finished_at: float | None = None
    cached_view: TrajectoryView | None = None

    def view(self) -> TrajectoryView:
        if self.cached_view is None:
            s = self.spec
            self.cached_view = TrajectoryView(
                s.id, s.group_id, s.prompt_id, self.started_at, self.turn, self.context,
                self.generated, s.turns[self.turn - 1].output_tokens if self.turn else 0,
                tuple(self.outcomes), self.llm_s, self.tool_s, self.queue_s, self.instance,
                self.phase)
        return self.cached_view

    def touch(self) -> None:
        self.cached_view = None

    # -------------------------------------------------------------- token streams
    def tokens(self, n: int) -> list[int]:
        """The first ``n`` tokens of this trajectory's stream."""
        toks = BASE[:n]
        p = self.spec.prompt_index
        head = min(n, 4)
        toks[:head] = [300 + ((p >> (8 * k)) & 255) for k in range(head)]
        if n > self.spec.prompt_tokens:
            toks[self.spec.prompt_tokens] = 1000 + self.index
        return toks

    def prompt_len(self) -> int:
        """Prompt length of the next call: context so far plus the new observation."""
        if self.turn == 0:
            return self.spec.prompt_tokens
        return self.context + self.spec.turns[self.turn - 1].obs_tokens

    def hashes_for(self, toks: list[int], block_size: int) -> list[int]:
        """Chain hashes of the full blocks of ``toks`` (extends the cached list)."""
        h = self.hashes
        parent = h[-1] if h else ROOT_HASH
        for b in range(len(h), len(toks) // block_size):
            parent = chain_hash(parent, toks[b * block_size:(b + 1) * block_size])
            h.append(parent)
        return h

    def remaining_output(self, generated: int) -> int:
        """Hidden truth (oracle and accuracy reports only)."""
        return self.spec.total_output - generated


@dataclass(slots=True)
class SimStats:
    """What a simulated batch counted (the reports read these)."""
    migrations: int = 0
    reconfigurations: int = 0
    preemptions: int = 0
    calls: int = 0
    failed_calls: int = 0  # calls the gateway's step failed (a policy fault)
    call_times: list[float] = field(default_factory=list)  # when each call became ready
    cache_hit_tokens: int = 0
    cache_query_tokens: int = 0
    predictions: list[tuple[float, int]] = field(default_factory=list)  # (pred, true)
    early: dict[str, float] = field(default_factory=dict)  # predicted total at call 3
    busy_gpu_s: float = 0.0  # engine step time x TP, summed (what the GPUs did)


class LiveViews(Mapping[str, TrajectoryView]):
    """Read-only mapping of live trajectory id -> view (views are built lazily, cached)."""

    def __init__(self, live: dict[str, Traj]) -> None:
        self._live = live

    def __getitem__(self, key: str) -> TrajectoryView:
        return self._live[key].view()

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)
