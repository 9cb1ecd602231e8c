"""Types shared by every policy: read-only views of the pool, trajectories and calls.

Policies are pure: they take these views and ``now`` and return a decision. They never
see ``max_tokens``, ``ignore_eos`` or any workload hint (the benchmark forces lengths
with those), only what a real gateway observes. This is enforced by construction: no view
below has a field for a hidden length; the oracle gets its hints through its constructor.

Two drivers call the same objects through :class:`Policy` (see ``docs/policies.md``):
the live gateway (``gateway/dispatch/``) and the discrete-event simulator (``bench/``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class CallView:
    """What the dispatcher knows of a call as it asks for a slot."""

    trajectory_id: str
    seq: int
    context_tokens: int


# --------------------------------------------------------------------------- snapshot


class InstanceState(enum.StrEnum):
    UP = "up"
    DRAINING = "draining"  # no new calls; running ones finish; then it stops
    STARTING = "starting"  # being (re)started with a new TP; not routable yet


class Phase(enum.StrEnum):
    QUEUED = "queued"  # a call waits in the gateway queue
    GENERATING = "generating"  # a call runs on an instance
    TOOL = "tool"  # between a completed call and the next one
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One serving instance (a vLLM server on ``gpus`` GPUs with TP ``tp``)."""

    id: str
    tp: int
    gpus: int
    state: InstanceState
    running: int  # calls dispatched to it and not finished (engine running + waiting)
    cap: int  # gateway-side concurrency cap: dispatch only while running < cap
    kv_usage: float = 0.0
    served: int = 0

    @property
    def up(self) -> bool:
        """Routable: neither draining nor starting."""
        return self.state == InstanceState.UP

    @property
    def placed(self) -> bool:
        """Up or starting: part of the layout the pool is heading to."""
        return self.state in (InstanceState.UP, InstanceState.STARTING)

    @property
    def free_slots(self) -> int:
        return self.cap - self.running if self.up else 0


@dataclass(frozen=True, slots=True)
class TrajectoryView:
    """What the gateway has observed about one trajectory (never its future)."""

    id: str
    group_id: str
    prompt_id: str  # prompt identity (hash of the first prompt): same across batches
    started_at: float
    turns: int  # completed LLM calls
    context_tokens: int  # tokens of the last prompt + completion
    generated_tokens: int  # completion tokens so far (the quantity predictors forecast)
    last_output_tokens: int = 0
    outcomes: tuple[str, ...] = ()  # tool states ``tool:size:outcome`` in order
    llm_time_s: float = 0.0
    tool_time_s: float = 0.0
    queue_time_s: float = 0.0
    instance: str | None = None  # where its prefix cache lives (last or prewarmed)
    phase: Phase = Phase.QUEUED


@dataclass(frozen=True, slots=True)
class GroupView:
    """A GRPO group: siblings share a prompt; finished siblings' lengths are observed."""

    id: str
    members: tuple[str, ...]
    finished_lengths: tuple[int, ...] = ()  # generated tokens of finished siblings
    finished_turns: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TPSpeed:
    """Speed of an instance of one TP degree: ``step(n) ~ per_token_s * (1 + slope*(n-1))``.

    ``slope`` is the interference factor F(n) = 1 + slope*(n-1) of Heddle's placement
    (section 5), fitted by the driver from its latency model or measurements.
    """

    per_token_s: float
    slope: float
    prefill_s_per_token: float = 0.0  # uncached prompt token cost (re-prefill on a move)
    # a decode step as a function of what is in it: fixed + per sequence + per context
    # token read (the KV term that dominates long agentic contexts); 0 when not fitted
    fixed_s: float = 0.0
    seq_s: float = 0.0
    ctx_s: float = 0.0
    kv_tokens: int = 0  # KV cache room of one instance, tokens (0: unknown)
    # decode step seconds at n sequences of no context, ((n, s), ...) by n: the measured
    # curve (weight streaming then compute), which a straight line through 64 and 128
    # sequences misses at a few sequences per instance; empty when not fitted
    curve: tuple[tuple[int, float], ...] = ()

    def step_s(self, n: int) -> float:
        return self.per_token_s * (1.0 + self.slope * max(0, n - 1))

    def batch_step_s(self, n: int, ctx_tokens: int) -> float:
        """One decode step of ``n`` sequences holding ``ctx_tokens`` of context in all."""
        return self.fixed_s + self.seq_s * n + self.ctx_s * ctx_tokens

    def decode_step_s(self, n: float, ctx_tokens: float) -> float:
        """:meth:`batch_step_s` with the step read off :attr:`curve` (linear between its
        points, the straight line beyond them) where one was fitted."""
        pts = self.curve
        if not pts or n >= pts[-1][0]:
            return self.fixed_s + self.seq_s * n + self.ctx_s * ctx_tokens
        lo = pts[0]
        for hi in pts:
            if n <= hi[0]:
                if hi[0] == lo[0]:
                    return hi[1] + self.ctx_s * ctx_tokens
                w = (n - lo[0]) / (hi[0] - lo[0])
                return lo[1] + w * (hi[1] - lo[1]) + self.ctx_s * ctx_tokens
            lo = hi
        return self.fixed_s + self.seq_s * n + self.ctx_s * ctx_tokens


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A call waiting in the gateway queue."""

    key: str  # unique per call (the driver's handle)
    trajectory_id: str
    seq: int
    context_tokens: int  # prompt tokens of this call
    enqueued_at: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a policy may read at one instant. Mappings are read-only by contract."""

    now: float
    total_gpus: int
    instances: tuple[InstanceView, ...]
    trajectories: Mapping[str, TrajectoryView]  # live (unfinished) trajectories
    groups: Mapping[str, GroupView]
    speeds: Mapping[int, TPSpeed]  # by TP degree
    restart_s: float = 10.8  # cost of (re)starting an instance with a new TP (Libra)
    finished: int = 0  # trajectories finished so far in this batch
    # engine seconds per wall second: ``speeds`` and ``restart_s`` are in engine time, the
    # trajectories' times in wall time (1 except on a time-compressed simulated pool)
    time_scale: float = 1.0
    # TP degrees whose speed no engine of this pool measured: it is the profile's, scaled by
    # a factor another degree measured (:class:`~gateway.dispatch.speeds.SpeedMeter`)
    borrowed: frozenset[int] = frozenset()

    def instance(self, instance_id: str | None) -> InstanceView | None:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        return None


# --------------------------------------------------------------------------- decisions


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send pending call ``key`` to ``instance`` now, with vLLM ``priority`` (lower first)."""

    key: str
    instance: str
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Migrate:
    """During a tool gap: prewarm ``target`` with the trajectory's context
    (``max_tokens: 1``), and route its next call there."""

    trajectory_id: str
    target: str


@dataclass(frozen=True, slots=True)
class Relayout:
    """Drain and stop ``retire``, then start instances with TP degrees ``launch`` on the
    freed GPUs (``sum(launch)`` equals the retired GPUs)."""

    retire: tuple[str, ...]
    launch: tuple[int, ...]
    reason: str = ""

    def changes(self, snap: Snapshot) -> bool:
        """Whether applying it would change ``snap``'s layout. A same-for-same swap (a TP2
        retired for a TP2) costs a drain and an engine start and changes nothing: the
        scheduler and the simulator neither apply nor count one."""
        retired = sorted(i.tp for i in snap.instances if i.id in self.retire)
        return retired != sorted(self.launch)


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted *remaining* generated tokens: mean and 90th percentile."""

    mean: float
    p90: float


class Policy(Protocol):
    """The contract both drivers call (``docs/policies.md``).

    Call order per trajectory: ``observe`` after every completed call and at the end;
    ``on_tool_gap`` when a call completes and the trajectory goes to its tool; pending
    calls go through ``schedule`` whenever the queue or a slot changes; ``plan`` every
    ``plan_interval_s`` of driver time (never when it is None). A driver that pauses the
    engines for a weight push may also call ``at_pause(snap) -> Relayout | None`` where a
    policy has it (:class:`~gateway.policies.compose.ComposedPolicy` does).
    """

    name: str
    label: str

    @property
    def plan_interval_s(self) -> float | None:
        """Driver time between ``plan`` calls (None: never)."""
        ...

    def initial_layout(self, gpus: int) -> tuple[int, ...]:
        """TP degrees of the instances to start with (they sum to ``gpus``)."""
        ...

    def observe(self, traj: TrajectoryView, groups: Mapping[str, GroupView], now: float) -> None:
        """Learn from a trajectory that just completed a call (or finished)."""
        ...

    def predict(self, traj: TrajectoryView, snap: Snapshot) -> Prediction | None:
        """Remaining generated tokens, for ranking and for accuracy reports."""
        ...

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        """Which pending calls to send now, where and with what priority."""
        ...

    def on_tool_gap(self, snap: Snapshot, traj: TrajectoryView) -> Migrate | None: ...

    def plan(self, snap: Snapshot) -> Relayout | None: ...


@dataclass(slots=True)
class Slots:
    """Free slots per instance while one ``schedule`` call hands them out."""

    free: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, snap: Snapshot) -> Slots:
        return cls({i.id: i.free_slots for i in snap.instances if i.free_slots > 0})

    def take(self, instance_id: str) -> None:
        left = self.free[instance_id] - 1
        if left:
            self.free[instance_id] = left
        else:
            del self.free[instance_id]
