"""Property-based lifecycle tests: random interleavings never wedge or mis-order.

A hypothesis ``RuleBasedStateMachine`` drives the real tracker, scheduler, dispatcher and
policies in process, the way the proxy does for each call (arrive, acquire a lease, run,
release, account), with random interleavings of: arrivals, calls ending (ok or failed),
client disconnects (queued or in flight), trajectory finishes, reuse of finished ids,
backends removed and added, policy switches, ticks (watchdog, planner). Invariants:

- every call ends: after the backends come back and every running call is let finish,
  no call is left queued or waiting (and while no backend is routable, the queue empties);
- counters return to zero: each trajectory's ``queued``/``in_flight`` and each backend's
  ``in_flight`` equal what is really outstanding, and reach 0 at the end;
- the stored sequence of each trajectory is consistent: within one attempt of an id the
  recorded calls (every call that reached a backend: ok, failed or cut) are numbered
  0, 1, 2, ... (``Tracker.record_seq``), never twice and without gaps, whatever left the
  queue before dispatch, and an attempt is opened only by a call on a finished id;
- no scheduling fault: no policy raises on any of these states.

The bounded ``ci`` profile (tests/conftest.py) runs in well under a minute; set
``HYPOTHESIS_PROFILE=deep`` for a longer search.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.config import DispatchSettings
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.scheduler import Scheduler
from gateway.dispatch.speeds import speeds_for
from gateway.errors import GatewayError
from gateway.policies.base import CallView
from gateway.policies.registry import get_policy
from gateway.trajectories.state import TrajectoryState
from gateway.trajectories.tracker import Tracker

MODEL = "qwen3-14b"
IDS = [f"p{p}-{s}" for p in range(3) for s in range(2)]  # reused across "steps"
POLICIES = ["straggler-lane", "progressive", "slime", "libra", "heddle", "las", "round-robin", "verl"]
BACKENDS = ["b0", "b1", "b2"]


@dataclass
class Call:
    tid: str
    state: TrajectoryState  # the attempt it arrived in
    attempt: int
    seq: int
    prompt: list[int]
    completion: list[int]
    done: asyncio.Future[bool]
    task: asyncio.Task[None] | None = None
    backend: Backend | None = None
    outcome: str | None = None


@dataclass
class Store:
    """What the trace writer would record: the seqs of the calls recorded, by (trajectory,
    attempt)."""

    seqs: dict[tuple[str, int], list[int]] = field(default_factory=dict)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.registry, self.tracker = BackendRegistry(), Tracker()
        self.settings = DispatchSettings(cap_per_gpu=1, backend_wait_s=0.0, migrate=True)
        for bid in BACKENDS:
            self.registry.add(self._backend(bid))
        self.scheduler = Scheduler(self.registry, self.tracker, get_policy("progressive"),
                                   speeds_for("qwen3-14b/H100"), self.settings)
        self.dispatcher = Dispatcher(self.registry, self.scheduler, settings=self.settings)
        self.calls: list[Call] = []
        self.store = Store()
        self.contexts: dict[str, list[int]] = {}
        self.counter = 0

    @staticmethod
    def _backend(bid: str) -> Backend:
        return Backend(bid, f"http://127.0.0.1/{bid}", tp=1, models={MODEL}, healthy=True)

    # ------------------------------------------------------------------ plumbing
    def _settle(self) -> None:
        async def spin() -> None:
            for _ in range(6):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())

    def _outstanding(self) -> list[Call]:
        return [c for c in self.calls if c.task is not None and not c.task.done()]

    def _running(self) -> list[Call]:
        return [c for c in self._outstanding() if c.backend is not None]

    async def _run(self, call: Call) -> None:
        """What the proxy does for one call (connect.connect, relay._run, lifecycle.end)."""
        view = CallView(call.tid, call.seq, len(call.prompt))
        try:
            lease = await self.dispatcher.acquire(view, MODEL)
        except GatewayError as exc:
            self.tracker.call_abandoned(call.state)
            call.outcome = type(exc).__name__
            return
        except asyncio.CancelledError:
            self.tracker.call_abandoned(call.state)
            call.outcome = "disconnected while queued"
            raise
        call.backend = lease.backend
        self.tracker.call_dispatched(call.state, lease.backend.id, 0.0)
        ok = False
        try:
            ok = await call.done
        except asyncio.CancelledError:
            call.outcome = "disconnected while running"
            raise
        finally:
            self.tracker.call_finished(call.state, now=time.time(), llm_s=0.001,
                                       prompt=call.prompt if ok else None,
                                       completion=call.completion if ok else [], ok=ok)
            self.scheduler.call_completed(call.state, ok=ok)
            call.seq = self.tracker.record_seq(call.state)  # lifecycle.end records it
            self.store.seqs.setdefault((call.tid, call.attempt), []).append(call.seq)
            lease.release(ok=ok)
            call.outcome = call.outcome or ("ok" if ok else "failed")

    # ------------------------------------------------------------------ rules
    @rule(tid=st.sampled_from(IDS), grouped=st.booleans(), n=st.integers(1, 3))
    def arrive(self, tid: str, grouped: bool, n: int) -> None:
        """``n`` calls of one trajectory arrive (an agent may send parallel calls)."""
        now = time.time()
        before = self.tracker.get(tid)
        state = self.tracker.touch(tid, tid.split("-")[0] if grouped else None, now)
        if before is not None and before.finished_at is not None:
            assert state is not before and state.attempt == before.attempt + 1
            self.contexts.pop(tid, None)
        elif before is not None:
            assert state is before
        context = self.contexts.setdefault(tid, [1, 2, 3])
        for _ in range(n):
            self.counter += 1
            seq = self.tracker.call_arrived(state, [], now)  # provisional until recorded
            prompt = list(context)
            completion = [100 + self.counter % 50] * (1 + self.counter % 4)
            context[:] = prompt + completion + [7]
            call = Call(tid, state, state.attempt, seq, prompt, completion,
                        self.loop.create_future())
            call.task = self.loop.create_task(self._run(call))
            self.calls.append(call)
        self._settle()

    @precondition(lambda self: bool(self._running()))
    @rule(pick=st.integers(0, 10_000), ok=st.booleans())
    def complete(self, pick: int, ok: bool) -> None:
        running = self._running()
        call = running[pick % len(running)]
        if not call.done.done():
            call.done.set_result(ok)
        self._settle()

    @precondition(lambda self: bool(self._outstanding()))
    @rule(pick=st.integers(0, 10_000))
    def disconnect(self, pick: int) -> None:
        outstanding = self._outstanding()
        task = outstanding[pick % len(outstanding)].task
        assert task is not None
        task.cancel()
        self._settle()

    @rule(tid=st.sampled_from(IDS), reward=st.floats(0, 1))
    def finish(self, tid: str, reward: float) -> None:
        """``POST /trajectories/{id}/finish`` (api/trajectories.py)."""
        live = self.tracker.get(tid)
        if live is not None and live.finished_at is None:
            self.tracker.finish(tid, reward, time.time())
            self.loop.run_until_complete(self._finished(live))
        self._settle()

    async def _finished(self, state: TrajectoryState) -> None:
        self.scheduler.trajectory_finished(state)

    @rule(bid=st.sampled_from(BACKENDS))
    def remove_backend(self, bid: str) -> None:
        self.registry.remove(bid)
        self.loop.run_until_complete(self._kick())
        self._settle()

    @rule(bid=st.sampled_from(BACKENDS))
    def add_backend(self, bid: str) -> None:
        if self.registry.get(bid) is None:
            self.registry.add(self._backend(bid))
        self.loop.run_until_complete(self._kick())
        self._settle()

    @rule(name=st.sampled_from(POLICIES))
    def switch_policy(self, name: str) -> None:
        self.loop.run_until_complete(self._switch(name))
        self._settle()

    async def _switch(self, name: str) -> None:
        self.scheduler.set_policy(get_policy(name))

    @rule()
    def tick(self) -> None:
        """The scheduler's periodic tick: a pass, the watchdog, the planner."""
        async def tick() -> None:
            self.scheduler.kick()
            self.scheduler.watch()
            await self.scheduler._plan()

        self.loop.run_until_complete(tick())
        self._settle()

    async def _kick(self) -> None:
        self.scheduler.kick()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def counters_match_what_is_outstanding(self) -> None:
        queued: dict[int, int] = {}
        running: dict[int, int] = {}
        per_backend: dict[int, int] = {}  # by object: a re-added id is a new backend
        for c in self._outstanding():
            if c.backend is None:
                queued[id(c.state)] = queued.get(id(c.state), 0) + 1
            else:
                running[id(c.state)] = running.get(id(c.state), 0) + 1
                per_backend[id(c.backend)] = per_backend.get(id(c.backend), 0) + 1
        states = {id(c.state): c.state for c in self.calls}
        for key, state in states.items():
            assert state.queued == queued.get(key, 0), (state.id, state.queued)
            assert state.in_flight == running.get(key, 0), (state.id, state.in_flight)
        backends = {id(b): b for b in self.registry}
        backends |= {id(c.backend): c.backend for c in self.calls if c.backend is not None}
        for key, b in backends.items():
            assert b.in_flight == per_backend.get(key, 0), (b.id, b.in_flight)
        assert self.scheduler.queue_depth == sum(queued.values())

    @invariant()
    def no_call_waits_without_a_backend(self) -> None:
        if not self.registry.routable(MODEL):
            assert self.scheduler.queue_depth == 0

    @invariant()
    def stored_sequences_are_consistent(self) -> None:
        for key, seqs in self.store.seqs.items():
            assert sorted(seqs) == list(range(len(seqs))), (key, seqs)
            tid, attempt = key
            latest = self.tracker.get(tid)
            assert latest is not None and attempt <= latest.attempt

    @invariant()
    def no_policy_raised(self) -> None:
        assert self.scheduler.faults == 0

    def teardown(self) -> None:
        try:
            for bid in BACKENDS:  # the pool comes back; every running call gets to end
                if self.registry.get(bid) is None:
                    self.registry.add(self._backend(bid))
            for _ in range(len(self.calls) + 5):
                self.loop.run_until_complete(self._kick())
                self._settle()
                running = self._running()
                if not running and not self._outstanding():
                    break
                for call in running:
                    if not call.done.done():
                        call.done.set_result(True)
                self._settle()
            stuck = self._outstanding()
            assert not stuck, [(c.tid, c.seq, c.backend) for c in stuck]
            assert all(c.outcome is not None for c in self.calls)
            assert self.scheduler.queue_depth == 0
            assert all(b.in_flight == 0 for b in self.registry)
            assert all(c.backend.in_flight == 0 for c in self.calls if c.backend is not None)
            assert all(s.queued == 0 and s.in_flight == 0 for s in self.tracker)
            assert all(c.state.queued == 0 and c.state.in_flight == 0 for c in self.calls)
        finally:
            for c in self._outstanding():
                assert c.task is not None
                c.task.cancel()
            self.loop.run_until_complete(self.scheduler.close())
            self.loop.close()


TestLifecycle = Lifecycle.TestCase
