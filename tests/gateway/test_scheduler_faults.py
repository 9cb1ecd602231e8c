"""Fault isolation in the scheduler: one bad call fails alone, the queue goes on.

The wedge these guard against: one entry on which the policy raised stopped every pass,
so every queued call of every trajectory waited. Now the call the policy raises on fails
with a clear 500 (``scheduling_failed``, OpenAI error shape), is counted (``/status``,
``rollout_gateway_scheduler_faults_total{stage}``) and logged once with its context,
while every other call is placed. A watchdog reports a queue that does not move beside
free slots, and kicks another pass.
"""

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
from gateway.errors import SchedulingFailed, TrajectoryFinished
from gateway.policies.base import Dispatch, PendingCall, Policy, Snapshot
from gateway.policies.registry import get_policy
from gateway.trajectories.tracker import Tracker
from tests.gateway.conftest import make_settings
from tests.servers import LoopThread, app_in_thread

MODEL = "qwen3-14b"


class Faulty:
    """A real policy that raises on any batch holding a trajectory whose id starts with
    ``bad`` (the shape of the reported bug: a lookup that fails for one entry)."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.name, self.label = "faulty", "faulty"
        self.raised = 0

    def __getattr__(self, attr: str) -> object:
        return getattr(self.inner, attr)

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        if any(c.trajectory_id.startswith("bad") for c in pending):
            self.raised += 1
            raise KeyError(next(c.trajectory_id for c in pending
                                if c.trajectory_id.startswith("bad")))
        return self.inner.schedule(snap, pending)


class Holding:
    """A policy with a bug that never dispatches anything."""

    name = label = "holding"
    plan_interval_s = None

    def schedule(self, snap: Snapshot, pending: Sequence[PendingCall]) -> list[Dispatch]:
        return []

    def observe(self, *a: object) -> None:
        return None


def _scheduler(policy: object, *, cap: int = 2, **kw: object) -> tuple[Scheduler, Tracker]:
    registry, tracker = BackendRegistry(), Tracker()
    for i in range(2):
        registry.add(Backend(f"b{i}", f"http://127.0.0.1:{9 + i}", tp=1, models={MODEL},
                             healthy=True))
    sched = Scheduler(registry, tracker, policy, speeds_for("qwen3-14b/H100"),  # type: ignore[arg-type]
                      DispatchSettings(cap_per_gpu=cap, **kw))  # type: ignore[arg-type]
    return sched, tracker


def _place(sched: Scheduler, tracker: Tracker, tid: str) -> asyncio.Task[object]:
    st = tracker.touch(tid, "g", time.time())
    seq = tracker.call_arrived(st, [], time.time())
    return asyncio.create_task(sched.place(tid, seq, 0, MODEL))


async def test_a_call_the_policy_raises_on_fails_alone_and_is_logged_once(caplog):
    policy = Faulty(get_policy("slime"))
    sched, tracker = _scheduler(policy)
    stages: list[str] = []
    sched.on_fault = stages.append
    caplog.set_level(logging.ERROR, logger="gateway.dispatch.scheduler")
    bad = _place(sched, tracker, "bad-0")
    good = [_place(sched, tracker, f"good-{i}") for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*good), 2)
    with pytest.raises(SchedulingFailed) as err:
        await asyncio.wait_for(bad, 2)
    assert err.value.status_code == 500 and err.value.code == "scheduling_failed"
    assert "'faulty' policy" in err.value.message and "KeyError" in err.value.message
    assert sched.faults == 1 and stages == ["policy"] and sched.queue_depth == 0
    # more passes (calls end, ticks) do not log it again: the call is gone from the queue
    for _ in range(5):
        sched.kick()
        await asyncio.sleep(0)
    records = [r for r in caplog.records if "raised scheduling call" in r.getMessage()]
    assert len(records) == 1
    assert "bad-0" in records[0].getMessage() and "faulty" in records[0].getMessage()
    assert records[0].exc_info is not None  # the traceback is kept, once
    # a fresh id after the fault is served at once
    backends = list(sched.registry)
    for b in backends:
        b.in_flight = 0
    assert await asyncio.wait_for(_place(sched, tracker, "fresh"), 2)


async def test_a_call_whose_trajectory_is_gone_fails_instead_of_waiting():
    sched, tracker = _scheduler(get_policy("ours"))
    st = tracker.touch("gone", "g", time.time())
    seq = tracker.call_arrived(st, [], time.time())
    tracker.live.pop("gone")  # what an eviction (or a bug) leaves behind
    with pytest.raises(SchedulingFailed, match="no longer live"):
        await asyncio.wait_for(sched.place("gone", seq, 0, MODEL), 2)
    assert sched.faults == 1 and sched.queue_depth == 0


async def test_queued_calls_of_a_finished_attempt_get_409_and_reuse_is_served():
    sched, tracker = _scheduler(get_policy("slime"), cap=1)
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


async def test_watchdog_reports_a_stuck_queue_once_and_kicks():
    sched, tracker = _scheduler(Holding(), watchdog_s=0.5)
    stages: list[str] = []
    sched.on_fault = stages.append
    stuck = _place(sched, tracker, "t0")
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    assert not sched.watch(t0)  # just queued: not yet a stall
    kicks = 0
    real_kick = sched.kick

    def counting_kick() -> None:
        nonlocal kicks
        kicks += 1
        real_kick()

    sched.kick = counting_kick  # type: ignore[method-assign]
    assert sched.watch(t0 + 1.0) and sched.watch(t0 + 2.0)
    assert sched.stalls == 1 and stages == ["stall"] and kicks == 2
    assert sched.stalled_for_s > 0
    # a dispatch clears the stall
    sched.set_policy(get_policy("slime"))
    await asyncio.wait_for(stuck, 2)
    assert not sched.watch() and sched.stalled_for_s == 0.0 and sched.stalls == 1


def test_the_gateway_answers_a_scheduling_fault_in_openai_shape_and_counts_it(
    sim_pool: list[str], sqlite_url: str, loop_thread: LoopThread
) -> None:
    app = create_app(make_settings(sqlite_url, sim_pool))
    with app_in_thread(loop_thread, lambda: app) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        sched = app.state.runtime.dispatcher.scheduler

        async def swap() -> None:
            sched.set_policy(Faulty(sched.policy))

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
