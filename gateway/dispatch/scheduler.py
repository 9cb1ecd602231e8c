"""The gateway-side queue, ordered and placed by a trajectory-aware policy.

Every call waits here until the active policy dispatches it: the policy sees a snapshot
(instances with their load and a per-instance concurrency cap, live trajectories, GRPO
groups, per-TP speeds) and the pending calls, and returns which to send where, with
which vLLM ``priority``. The cap (``cap_per_gpu`` x GPUs) keeps most waiting in this
queue, where ordering decisions still matter, instead of in vLLM's own FCFS backlog.

Scheduling runs whenever something changes (a call arrives, a call ends, the pool
changes) and on a periodic tick (so aging priorities and a reconfigured pool are seen),
coalesced to one pass per event-loop iteration. Between calls the driver also gives the
policy its other two hooks: ``observe``/``on_tool_gap`` when a call completes (a
migration prewarms the target's prefix cache with a ``max_tokens: 1`` call of the
trajectory's exact token context) and ``plan`` every ``plan_interval_s`` (layout changes
are handed to the managed pool, if there is one).

Each pass per model is ``gateway/dispatch/step.py``'s ``schedule_pass``, the pure step the
discrete-event simulator (``bench/simulator/des.py``) runs too: retries to the least loaded
untried backend, stale calls failed, a raising policy isolated to the calls it raises on,
the cap held. This module only applies its answer (resolving futures, counting faults) and
keeps what is the gateway's own: the queue's futures and timeouts, backends that vanish
(``backend_wait_s``), the watchdog and the policy's other hooks. Time comes from the
injected ``clock`` (intervals) and ``wall`` (what policies see), so tests use a fake clock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Set

from gateway.config import DispatchSettings
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.dispatch.shares import fair_shares
from gateway.dispatch.speeds import SpeedMeter
from gateway.dispatch.step import STALE, Failure, Queued, schedule_pass
from gateway.dispatch.views import Groups, LiveTrajectories, instance_view, trajectory_view
from gateway.dispatch.waiters import Placed, Waiter, expire_unroutable, fail_ended, gone_error
from gateway.dispatch.watchdog import Watchdog
from gateway.errors import (
    Overloaded,
    QueueTimeout,
    SchedulingFailed,
)
from gateway.loops import Periodic
from gateway.policies.base import (
    Migrate,
    PendingCall,
    Policy,
    Relayout,
    Snapshot,
    TPSpeed,
)
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tracker import Tracker

log = logging.getLogger(__name__)
KvLookup = Callable[[str], float | None]
Clock = Callable[[], float]


class Scheduler:
    def __init__(self, registry: BackendRegistry, tracker: Tracker, policy: Policy,
                 speeds: dict[int, TPSpeed], settings: DispatchSettings, *,
                 clock: Clock = time.monotonic, wall: Clock = time.time) -> None:
        self.clock = clock  # intervals: the plan interval, the watchdog
        self.wall = wall  # what policies see: enqueue times, the snapshot's ``now``
        self.registry = registry
        self.tracker = tracker
        self.policy = policy
        self.speeds = speeds  # the profile's (the prior)
        self.meter = SpeedMeter(speeds, settings.time_scale)  # what the policy believes
        self.settings = settings
        self.kv_usage: KvLookup = lambda _id: None
        self.on_migrate: Callable[[TrajectoryState, Migrate], None] | None = None
        self.on_relayout: Callable[[Relayout], Awaitable[None]] | None = None
        self._waiting: dict[str, Waiter] = {}
        self.running: Counter[str] = Counter()  # calls placed and not released, per family
        self._keys = itertools.count()
        self._kick: asyncio.Handle | None = None
        self.ticker = Periodic("scheduler-tick", self._tick, settings.tick_s, logger=log)
        self._last_plan = self.clock()
        self.dispatched = 0
        self.migrations = 0
        self.relayouts = 0
        self.faults = 0  # calls failed because scheduling them raised
        self.on_fault: Callable[[str], None] | None = None
        self.watchdog = Watchdog(settings.watchdog_s, clock)
        #: Whether capacity is on its way (a managed pool starting instances); set by the
        #: dispatcher. Queued calls outlive ``backend_wait_s`` without a routable backend
        #: only while it says so.
        self.expecting_capacity: Callable[[], bool] = lambda: False

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._last_plan = self.clock()
        self.ticker.start()

    async def close(self) -> None:
        await self.ticker.close()
        for w in list(self._waiting.values()):
            if not w.future.done():
                w.future.set_exception(Overloaded("the gateway is shutting down"))
        self._waiting.clear()

    @property
    def time_scale(self) -> float:
        """Policy seconds per wall second: ``DispatchSettings.time_scale``, until an
        embedding process whose simulated pool slows its clock says otherwise
        (:meth:`set_time_scale`, the demo)."""
        return self.meter.time_scale

    def set_time_scale(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"time_scale must be positive, got {scale}")
        self.meter.time_scale = scale

    async def _tick(self) -> None:
        """The periodic pass: aging priorities, the watchdog, the policy's ``plan``."""
        self.kick()
        self.watch()
        interval = self.policy.plan_interval_s
        if interval and self.clock() - self._last_plan >= interval / self.time_scale:
            self._last_plan = self.clock()
            await self._plan()

    def watch(self, now: float | None = None) -> bool:
        """The watchdog (``gateway.dispatch.watchdog``): is the queue stuck while a
        backend has a free slot? A stall is logged once, with what waits, and another
        pass is forced. Returns whether the queue is stalled now."""
        now = self.clock() if now is None else now
        stalled, began = self.watchdog.check(
            now, bool(self._waiting) and self._has_free_slot())
        if began:
            oldest = min(w.call.enqueued_at for w in self._waiting.values())
            log.error("scheduler stalled: %d calls queued (oldest %.1fs) while backends have "
                      "free slots; policy %s", len(self._waiting), self.wall() - oldest,
                      self.policy.name)
            if self.on_fault is not None:
                self.on_fault("stall")
        if stalled:
            self.kick()
        return stalled

    @property
    def stalls(self) -> int:
        return self.watchdog.stalls

    @property
    def stalled_for_s(self) -> float:
        return self.watchdog.stalled_for_s

    def _has_free_slot(self) -> bool:
        models = {w.model for w in self._waiting.values()}
        return any(b.in_flight < self._cap(b) for m in models for b in self.registry.routable(m))

    def set_policy(self, policy: Policy) -> None:
        """Switch policies at run time; queued calls are rescheduled by the new one."""
        self.policy = policy
        self.kick()

    # ------------------------------------------------------------------ the queue
    async def place(self, trajectory_id: str, seq: int, context_tokens: int, model: str,
                    exclude: Iterable[str] = (), family: str | None = None) -> Placed:
        """Wait until the policy dispatches this call; returns (backend, priority).

        ``family`` is the model the call is for when it is a LoRA family of ``model``. The
        backend's ``in_flight`` and the family's ``running`` are already counted when this
        returns; the caller releases both through its lease (:meth:`released`).
        """
        if len(self._waiting) >= self.settings.max_queued:
            raise Overloaded(f"{len(self._waiting)} calls already queued in the gateway",
                             retry_after_s=self.settings.overload_retry_after_s)
        key = f"q{next(self._keys)}"
        fut: asyncio.Future[Placed] = asyncio.get_running_loop().create_future()
        call = PendingCall(key, trajectory_id, seq, context_tokens, self.wall())
        self._waiting[key] = Waiter(call, model, frozenset(exclude), fut, family or model)
        self.kick()
        try:
            async with asyncio.timeout(self.settings.queue_timeout_s):
                return await fut
        except TimeoutError:
            self._give_back(fut, family or model)
            raise QueueTimeout(
                f"call waited {self.settings.queue_timeout_s:g}s in the gateway queue "
                "without being placed; nothing ran it, send it again",
                retry_after_s=self.settings.overload_retry_after_s) from None
        except asyncio.CancelledError:
            self._give_back(fut, family or model)
            raise
        finally:
            self._waiting.pop(key, None)

    def _give_back(self, fut: asyncio.Future[Placed], family: str) -> None:
        """The call was placed but its caller is gone: return the slot."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            backend, _ = fut.result()
            backend.in_flight -= 1
            self.released(family)
        elif not fut.done():
            fut.cancel()

    def released(self, family: str) -> None:
        """A call of ``family`` placed by :meth:`place` ended (its lease was released)."""
        if self.running[family] > 1:
            self.running[family] -= 1
        else:
            del self.running[family]
        self.kick()

    def kick(self) -> None:
        """Schedule a pass at the next loop iteration (many kicks, one pass)."""
        if self._kick is None and self._waiting:
            self._kick = asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._kick = None
        by_model: dict[str, list[Waiter]] = {}
        for w in self._waiting.values():
            if not w.future.done():
                by_model.setdefault(w.model, []).append(w)
        for model, waiters in by_model.items():
            try:
                self._schedule_model(model, waiters)
            except Exception as exc:  # outside the policy (a snapshot, a view): fail the
                log.exception("scheduling pass for %s failed; failing its %d queued calls",
                              model, len(waiters))  # pass's calls rather than wedge them
                for w in waiters:
                    self._fail(w, "policy", SchedulingFailed(
                        f"the scheduler failed placing calls for {model!r} "
                        f"({type(exc).__name__}: {exc}); retry the call"))

    def _cap(self, b: Backend) -> int:
        return self.settings.cap_per_gpu * (len(b.gpus) or (b.tp or 1))

    def _schedule_model(self, model: str, waiters: list[Waiter]) -> None:
        """One pass over ``model``'s queue; when several families wait for more calls
        than it has free slots, one pass per family bounded by its fair share, the most
        starved first, then one over the calls left (``gateway.dispatch.shares``)."""
        backends = {b.id: b for b in self.registry.routable(model)}
        if not backends:
            self._expire_unroutable(model, waiters)
            return
        families: dict[str, list[Waiter]] = {}
        for w in waiters:
            families.setdefault(w.family, []).append(w)
        free = sum(max(0, self._cap(b) - b.in_flight) for b in backends.values())
        if len(families) < 2 or free >= len(waiters):
            self._pass(backends, waiters)
            return
        weights = self.settings.model_shares
        shares = fair_shares(free, {f: len(ws) for f, ws in families.items()}, self.running,
                             weights)
        for family in sorted(shares, key=lambda f: self.running[f] / weights.get(f, 1.0)):
            if shares[family]:
                self._pass(backends, families[family], limit=shares[family])
        left = [w for w in waiters if not w.future.done()]
        if left:  # a family that took less than its share leaves slots to the others
            self._pass(backends, left)

    def _pass(self, backends: dict[str, Backend], waiters: list[Waiter],
              limit: int | None = None) -> None:
        """The policy's pass over ``waiters``; at most ``limit`` placed (the first ones of
        its answer: policies answer in their order of priority)."""
        by_key = {w.call.key: w for w in waiters}
        done = schedule_pass(self.policy, self.snapshot(backends.values()),
                             [Queued(w.call, w.exclude) for w in waiters], self.tracker.live)
        for f in done.failed:
            self._failed(by_key[f.call.key], f)
        if done.isolated:  # the bad calls are out: the next pass is a batch again
            asyncio.get_running_loop().call_soon(self.kick)
        for d in done.placed[:limit]:
            waiter = by_key[d.key]
            if not waiter.future.done():
                self._resolve(waiter, backends[d.instance], d.priority)

    def _expire_unroutable(self, model: str, waiters: list[Waiter]) -> None:
        """Every backend of ``model`` went away while these calls waited: unless capacity
        is on its way, fail those that have waited ``backend_wait_s``."""
        if not self.expecting_capacity():
            expire_unroutable(model, waiters, self.wall() - self.settings.backend_wait_s)

    def trajectories_ended(self, trajectory_ids: Set[str]) -> int:
        """Their attempts were finished: calls of them still queued fail with 409."""
        return fail_ended(list(self._waiting.values()), trajectory_ids)

    def _failed(self, w: Waiter, f: Failure) -> None:
        call = f.call
        if f.reason == STALE:  # its trajectory is gone from the live set: never hold it
            error = gone_error(call.trajectory_id, self.tracker.get(call.trajectory_id))
            if isinstance(error, SchedulingFailed):  # evicted while queued: a fault
                self._fail(w, "stale", error)
            elif not w.future.done():  # its attempt ended while the call waited: a 409
                w.future.set_exception(error)
            return
        log.error("policy %s raised scheduling call %s of trajectory %r (seq %d); the call "
                  "fails, the queue goes on", self.policy.name, call.key, call.trajectory_id,
                  call.seq, exc_info=f.error)
        self._fail(w, "policy", SchedulingFailed(
            f"the {self.policy.name!r} policy failed to schedule this call of trajectory "
            f"{call.trajectory_id!r} ({type(f.error).__name__}: {f.error}); "
            "other calls are unaffected"))

    def _count_fault(self, stage: str) -> None:
        self.faults += 1
        if self.on_fault is not None:
            self.on_fault(stage)

    def _fail(self, w: Waiter, stage: str, error: Exception) -> None:
        self._count_fault(stage)
        if not w.future.done():
            w.future.set_exception(error)

    def _resolve(self, w: Waiter, backend: Backend, priority: int) -> None:
        backend.in_flight += 1  # in the same step as the choice (pool drain contract)
        self.running[w.family] += 1
        self.dispatched += 1
        self.watchdog.progress()
        w.future.set_result((backend, priority))

    def snapshot(self, backends: Iterable[Backend] | None = None) -> Snapshot:
        chosen = list(backends) if backends is not None else list(self.registry)
        instances = tuple(instance_view(b, self.settings.cap_per_gpu, self.kv_usage(b.id))
                          for b in chosen)
        return Snapshot(
            now=self.wall(), total_gpus=sum(i.gpus for i in instances), instances=instances,
            trajectories=LiveTrajectories(self.tracker), groups=Groups(self.tracker),
            speeds=self.meter.current(), restart_s=self.settings.restart_s,
            finished=self.tracker.finished_count, time_scale=self.time_scale,
            borrowed=self.meter.borrowed())

    # ------------------------------------------------------------------ hooks
    def call_completed(self, state: TrajectoryState, *, ok: bool) -> None:
        """A call ended: the policy learns, and may move the trajectory during its tool gap.

        Runs on the request path of the call that ended: a policy error here is logged and
        counted, never raised into the call (its answer and trace are already made)."""
        self.kick()
        if not ok or state.auto or state.finished_at is not None:
            return
        try:
            self._after_call(state)
        except Exception:
            log.exception("policy %s failed after a call of trajectory %r", self.policy.name,
                          state.id)
            self._count_fault("observe")

    def _after_call(self, state: TrajectoryState) -> None:
        view = trajectory_view(state)
        self.policy.observe(view, Groups(self.tracker), self.wall())
        if not self.settings.migrate or state.in_flight or state.queued:
            return
        routable = [b for b in self.registry if b.routable]
        if len(routable) < 2:
            return
        move = self.policy.on_tool_gap(self.snapshot(routable), view)
        if move is not None and move.target != state.backend_id and \
                self.registry.get(move.target) is not None:
            self.tracker.prefer(state, move.target)
            self.migrations += 1
            if self.on_migrate is not None:
                self.on_migrate(state, move)

    def call_arrived(self, state: TrajectoryState) -> None:
        """A call arrived (its prompt may carry new tool results): the policy learns them
        before the call is queued, as the simulator does when a tool gap ends."""
        if state.auto or state.finished_at is not None:
            return
        self._learn(state, "a call")  # the call itself goes on whatever the policy does

    def trajectory_finished(self, state: TrajectoryState) -> None:
        self.trajectories_ended({state.id})
        self._learn(state, "the end")  # the finish itself has landed
        self.kick()

    def _learn(self, state: TrajectoryState, what: str) -> None:
        """``observe``, best effort: a policy error is logged and counted, never raised."""
        try:
            self.policy.observe(trajectory_view(state), Groups(self.tracker), self.wall())
        except Exception:
            log.exception("policy %s failed to observe %s of trajectory %r",
                          self.policy.name, what, state.id)
            self._count_fault("observe")

    async def _plan(self) -> None:
        try:
            snap = self.snapshot()
            change = self.policy.plan(snap)
        except Exception:  # a planner bug must not stop the scheduler
            log.exception("policy %s failed to plan", self.policy.name)
            self._count_fault("plan")
            return
        if change is None or self.on_relayout is None or not change.changes(snap):
            return
        self.relayouts += 1
        await self.on_relayout(change)
