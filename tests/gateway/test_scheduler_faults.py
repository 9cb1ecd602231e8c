"""One bad entry never stops the queue: faults fail their own call, a watchdog sees stalls.

The failing call gets a clear 500 (``scheduling_failed``, OpenAI error shape), is counted
(``/status``, ``rollout_gateway_scheduler_faults_total{stage}``) and logged once with its
context, while every other call is placed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import httpx
import pytest

from gateway.app import create_app
from gateway.config import DispatchSettings
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.dispatch.scheduler import Scheduler
from gateway.dispatch.speeds import speeds_for
from gateway.errors import SchedulingFailed, TrajectoryAborted, TrajectoryFinished
from gateway.policies.base import Dispatch, PendingCall, Snapshot
from gateway.policies.registry import get_policy
from gateway.trajectories.tracker import Tracker
from tests.gateway.conftest import make_settings
from tests.gateway.test_scheduler import MODEL, _call, _scheduler
from tests.servers import LoopThread, app_in_thread


class Poisoned:
    """Wraps a real policy; raises whenever a batch holds a call of the ``bad`` trajectory
    (the shape of the KeyError that once stopped every pass)."""

    def __init__(self, inner: object, bad: str) -> None:
        self._inner, self.bad = inner, bad

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        if any(c.trajectory_id == self.bad for c in pending):
            raise KeyError(self.bad)
        return self._inner.schedule(snap, pending)  # type: ignore[attr-defined, no-any-return]


class Idle:
    """A policy that never dispatches anything (a stuck planner, say)."""

    name = "idle"
    plan_interval_s = None

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        return []


async def test_a_call_the_policy_raises_on_fails_alone_and_the_rest_are_placed():
    sched, backends, tracker = _scheduler(n_backends=2, cap=2)
    sched.policy = Poisoned(sched.policy, bad="poison")  # type: ignore[assignment]
    stages: list[str] = []
    sched.on_fault = stages.append
    good = [asyncio.create_task(sched.place(*_call(tracker, f"ok{i}"), MODEL)) for i in range(3)]
    bad = asyncio.create_task(sched.place(*_call(tracker, "poison"), MODEL))
    await asyncio.sleep(0.02)
    with pytest.raises(SchedulingFailed, match="KeyError"):
        await bad
    placed = await asyncio.gather(*good)
    assert len(placed) == 3 and sum(b.in_flight for b in backends) == 3
    assert sched.faults == 1 and stages == ["policy"] and sched.queue_depth == 0
    # the queue keeps working after the fault, batch path included
    more = [asyncio.create_task(sched.place(*_call(tracker, f"later{i}"), MODEL))
            for i in range(1)]
    assert len(await asyncio.gather(*more)) == 1


async def test_isolation_respects_free_slots():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    sched.policy = Poisoned(sched.policy, bad="poison")  # type: ignore[assignment]
    calls = [asyncio.create_task(sched.place(*_call(tracker, f"t{i}"), MODEL)) for i in range(3)]
    bad = asyncio.create_task(sched.place(*_call(tracker, "poison"), MODEL))
    await asyncio.sleep(0.02)
    assert bad.done() and isinstance(bad.exception(), SchedulingFailed)
    assert sum(t.done() for t in calls) == 1 and backends[0].in_flight == 1
    for t in calls:
        t.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


async def test_a_call_whose_trajectory_left_the_live_set_fails_clearly():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    busy = await sched.place(*_call(tracker, "a"), MODEL)
    waiting = asyncio.create_task(sched.place(*_call(tracker, "gone"), MODEL))
    await asyncio.sleep(0.01)
    tracker.live.pop("gone")  # evicted or otherwise lost while queued
    busy[0].in_flight -= 1
    sched.kick()
    with pytest.raises(SchedulingFailed, match="no longer live"):
        await waiting
    assert sched.faults == 1 and backends[0].in_flight == 0


@pytest.mark.parametrize("aborted", [True, False])
async def test_a_call_queued_after_its_attempt_ended_gets_the_409_of_its_end(
        aborted: bool) -> None:
    """A call that waited before the queue (the pause of a weight push) while its
    attempt ended (the staleness bound aborted it, or the trainer finished it) enters
    the queue after the queued calls of the attempt were failed: it gets the same 409 as
    they did, not a 500, and is no scheduler fault."""
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    busy = await sched.place(*_call(tracker, "a"), MODEL)
    call = _call(tracker, "late")
    tracker.finish("late", None, time.time(), aborted="staleness" if aborted else None)
    waiting = asyncio.create_task(sched.place(*call, MODEL))
    busy[0].in_flight -= 1
    sched.kick()
    with pytest.raises(TrajectoryAborted if aborted else TrajectoryFinished) as err:
        await asyncio.wait_for(waiting, 2)
    assert err.value.status_code == 409 and sched.faults == 0
    assert backends[0].in_flight == 0


async def test_finishing_a_trajectory_fails_its_queued_calls_with_409():
    sched, backends, tracker = _scheduler(n_backends=1, cap=1)
    await sched.place(*_call(tracker, "a"), MODEL)
    queued = asyncio.create_task(sched.place(*_call(tracker, "b"), MODEL))
    other = asyncio.create_task(sched.place(*_call(tracker, "c"), MODEL))
    await asyncio.sleep(0.01)
    state = tracker.get("b")
    assert state is not None
    tracker.finish("b", 1.0, time.time())
    sched.trajectory_finished(state)
    with pytest.raises(TrajectoryFinished):
        await queued
    assert not other.done() and sched.faults == 0
    backends[0].in_flight -= 1
    sched.kick()
    await asyncio.wait_for(other, 1)


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


async def test_watchdog_reports_a_queue_stuck_beside_free_slots_once():
    clock = FakeClock()
    sched, backends, tracker = _scheduler(n_backends=1, cap=1, clock=clock, watchdog_s=0.05)
    sched.policy = Idle()  # type: ignore[assignment]
    stages: list[str] = []
    sched.on_fault = stages.append
    stuck = asyncio.create_task(sched.place(*_call(tracker, "s"), MODEL))
    await asyncio.sleep(0)  # queued, its pass run
    clock.advance(0.01)
    assert not sched.watch()  # not yet: under watchdog_s
    clock.advance(0.06)
    assert sched.watch() and sched.watch()  # stalled, reported once
    assert sched.stalls == 1 and stages == ["stall"] and sched.stalled_for_s > 0.05
    stuck.cancel()
    await asyncio.gather(stuck, return_exceptions=True)
    assert not sched.watch() and sched.stalled_for_s == 0


async def test_watchdog_is_quiet_when_the_pool_is_simply_full():
    clock = FakeClock()
    sched, backends, tracker = _scheduler(n_backends=1, cap=1, clock=clock, watchdog_s=0.01)
    await sched.place(*_call(tracker, "a"), MODEL)
    waiting = asyncio.create_task(sched.place(*_call(tracker, "b"), MODEL))
    await asyncio.sleep(0)  # queued, its pass run
    clock.advance(0.05)
    assert not sched.watch() and sched.stalls == 0
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


def _sched(policy: object, *, cap: int = 2) -> tuple[Scheduler, Tracker]:
    registry, tracker = BackendRegistry(), Tracker()
    for i in range(2):
        registry.add(Backend(f"b{i}", f"http://127.0.0.1:{9 + i}", tp=1, models={MODEL},
                             healthy=True))
    sched = Scheduler(registry, tracker, policy, speeds_for("qwen3-14b/H100"),  # type: ignore[arg-type]
                      DispatchSettings(cap_per_gpu=cap))
    return sched, tracker


def _place(sched: Scheduler, tracker: Tracker, tid: str) -> asyncio.Task[object]:
    st = tracker.touch(tid, "g", time.time())
    seq = tracker.call_arrived(st, [], time.time())
    return asyncio.create_task(sched.place(tid, seq, 0, MODEL))


async def test_a_call_the_policy_raises_on_fails_alone_and_is_logged_once(caplog):
    policy = Poisoned(get_policy("slime"), bad="bad-0")
    sched, tracker = _sched(policy)
    stages: list[str] = []
    sched.on_fault = stages.append
    caplog.set_level(logging.ERROR, logger="gateway.dispatch.scheduler")
    bad = _place(sched, tracker, "bad-0")
    good = [_place(sched, tracker, f"good-{i}") for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*good), 2)
    with pytest.raises(SchedulingFailed) as err:
        await asyncio.wait_for(bad, 2)
    assert err.value.status_code == 500 and err.value.code == "scheduling_failed"
    assert "policy failed to schedule" in err.value.message and "bad-0" in err.value.message
    assert sched.faults == 1 and stages == ["policy"] and sched.queue_depth == 0
    # more passes (calls end, ticks) do not log it again: the call is gone from the queue
    for _ in range(5):
        sched.kick()
        await asyncio.sleep(0)
    records = [r for r in caplog.records if "raised scheduling call" in r.getMessage()]
    assert len(records) == 1
    assert "bad-0" in records[0].getMessage() and policy.name in records[0].getMessage()
    assert records[0].exc_info is not None  # the traceback is kept, once
    # a fresh id after the fault is served at once
    backends = list(sched.registry)
    for b in backends:
        b.in_flight = 0
    assert await asyncio.wait_for(_place(sched, tracker, "fresh"), 2)


async def test_queued_calls_of_a_finished_attempt_get_409_and_reuse_is_served():
    sched, tracker = _sched(get_policy("slime"), cap=1)
    holders = [_place(sched, tracker, f"h{i}") for i in range(2)]  # both backends full
    await asyncio.sleep(0.01)
    waiting = _place(sched, tracker, "reuse")
    await asyncio.sleep(0.01)
    assert not waiting.done()
    state = tracker.get("reuse")
    assert state is not None
    tracker.finish("reuse", 1.0, time.time())
    sched.trajectory_finished(state)
    with pytest.raises(TrajectoryFinished) as err:
        await asyncio.wait_for(waiting, 2)
    assert err.value.status_code == 409
    tracker.call_abandoned(state)
    # the id is reused: a new attempt, placed when a slot frees
    again = _place(sched, tracker, "reuse")
    assert tracker.get("reuse").attempt == 1  # type: ignore[union-attr]
    backend, _ = (await holders[0])  # type: ignore[misc]
    backend.in_flight -= 1
    sched.kick()
    await asyncio.wait_for(again, 2)
    await asyncio.gather(*holders)


def test_the_gateway_answers_a_scheduling_fault_in_openai_shape_and_counts_it(
    sim_pool: list[str], sqlite_url: str, loop_thread: LoopThread
) -> None:
    app = create_app(make_settings(sqlite_url, sim_pool))
    with app_in_thread(loop_thread, lambda: app) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        sched = app.state.runtime.dispatcher.scheduler

        async def swap() -> None:
            sched.set_policy(Poisoned(sched.policy, bad="bad-1"))

        loop_thread.run(swap())
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        r = c.post("/t/bad-1/v1/chat/completions", json=body)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "scheduling_failed" and err["type"] == "server_error"
        assert "KeyError" in err["message"] and "bad-1" in err["message"]
        ok = c.post("/t/good-1/v1/chat/completions", json=body)
        assert ok.status_code == 200, ok.text
        status = c.get("/status").json()["scheduler"]
        assert status["faults"] == 1 and status["queued"] == 0 and status["stalls"] == 0
        metrics = c.get("/metrics").text
        assert 'rollout_gateway_scheduler_faults_total{stage="policy"} 1.0' in metrics
        assert 'rollout_gateway_scheduler_faults_total{stage="stall"} 0.0' in metrics
        # like any call refused before it reached a backend, it holds nothing afterwards
        bad = app.state.runtime.tracker.get("bad-1")
        assert bad is not None and (bad.queued, bad.in_flight) == (0, 0)
        assert sum(b.in_flight for b in app.state.runtime.registry) == 0
