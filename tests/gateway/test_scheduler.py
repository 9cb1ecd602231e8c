"""The live policy driver: queue, cap, priorities, cancellation, policy switch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable

import httpx
import pytest

from gateway.config import DispatchSettings
from gateway.dispatch.backends import Backend, BackendRegistry
from gateway.dispatch.scheduler import Scheduler
from gateway.dispatch.speeds import speeds_for
from gateway.errors import Overloaded
from gateway.policies.registry import get_policy
from gateway.trajectories.tracker import Tracker

MODEL = "qwen3-14b"


def _scheduler(n_backends: int = 2, cap: int = 1, policy: str = "slime",
               clock: Callable[[], float] = time.monotonic,
               **kw: object) -> tuple[Scheduler, list[Backend], Tracker]:
    registry, tracker = BackendRegistry(), Tracker()
    backends = [registry.add(Backend(f"b{i}", f"http://127.0.0.1:{9 + i}", tp=1,
                                     models={MODEL}, healthy=True)) for i in range(n_backends)]
    settings = DispatchSettings(cap_per_gpu=cap, **kw)  # type: ignore[arg-type]
    sched = Scheduler(registry, tracker, get_policy(policy), speeds_for("qwen3-14b/H100"),
                      settings, clock=clock)
    return sched, backends, tracker


def _call(tracker: Tracker, tid: str) -> tuple[str, int, int]:
    st = tracker.touch(tid, "g", time.time())
    return tid, tracker.call_arrived(st, [], time.time()), 0


async def test_cap_holds_calls_in_the_gateway_queue_until_a_slot_frees():
    sched, backends, tracker = _scheduler()
    tasks = [asyncio.create_task(sched.place(*_call(tracker, f"t{i}"), MODEL)) for i in range(5)]
    await asyncio.sleep(0.01)
    done = [t for t in tasks if t.done()]
    assert len(done) == 2 and sched.queue_depth == 3
    assert sorted(b.in_flight for b in backends) == [1, 1]
    backend, _ = done[0].result()
    backend.in_flight -= 1  # what Lease.release does
    sched.kick()
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in tasks) == 3 and sched.queue_depth == 2
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert sched.queue_depth == 0


async def test_cancelled_while_queued_leaves_no_trace_and_placed_then_cancelled_gives_back():
    sched, backends, tracker = _scheduler(n_backends=1)
    first = asyncio.create_task(sched.place(*_call(tracker, "a"), MODEL))
    queued = asyncio.create_task(sched.place(*_call(tracker, "b"), MODEL))
    await asyncio.sleep(0.01)
    assert first.done() and not queued.done()
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert sched.queue_depth == 0 and backends[0].in_flight == 1
    # placed in the same iteration as its caller is cancelled: the slot must come back
    backends[0].in_flight = 0
    racer = asyncio.create_task(sched.place(*_call(tracker, "c"), MODEL))
    await asyncio.sleep(0)  # queued, kick scheduled
    asyncio.get_running_loop().call_soon(racer.cancel)
    await asyncio.gather(racer, return_exceptions=True)
    await asyncio.sleep(0.01)
    assert backends[0].in_flight == 0


async def test_overload_answers_retry_after():
    sched, _, tracker = _scheduler(n_backends=1, max_queued=2)
    tasks = []
    for i in range(3):  # one placed (cap 1), two queued: the queue is full
        tasks.append(asyncio.create_task(sched.place(*_call(tracker, f"t{i}"), MODEL)))
        await asyncio.sleep(0.01)
    assert sched.queue_depth == 2
    with pytest.raises(Overloaded) as err:
        await sched.place(*_call(tracker, "late"), MODEL)
    assert err.value.headers["Retry-After"] == "2"
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_retry_avoids_the_backend_it_already_tried():
    sched, _, tracker = _scheduler(cap=4)
    for _ in range(5):
        backend, _ = await sched.place(*_call(tracker, "r"), MODEL, exclude=["b0"])
        assert backend.id == "b1"
        backend.in_flight -= 1


def test_live_gateway_dispatches_by_policy_and_switches_policy(sim_pool, gateway_at,
                                                               sqlite_url):
    hdr = {"authorization": "Bearer tok"}
    with gateway_at(sqlite_url, sim_pool, admin_token="tok", api_keys=["hk"],
                    dispatch={"cap_per_gpu": 1}) as gw:
        def call(i: int) -> int:
            return httpx.post(f"{gw}/g/grp/t/traj-{i}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 600, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"task {i}"}]},
                headers={"authorization": "Bearer hk"}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(call, range(8)))
        assert codes == [200] * 8
        seen = [r for u in sim_pool for r in httpx.get(f"{u}/sim/stats").json()["requests_seen"]]
        assert all(isinstance(r["priority"], int) for r in seen[-8:])
        queued = [httpx.get(f"{gw}/trajectories/traj-{i}", headers=hdr).json()["calls"][0][
            "queued_ms"] for i in range(8)]
        assert sum(q > 50 for q in queued) >= 4  # cap 1 x 2 backends: most had to wait
        assert httpx.get(f"{gw}/admin/policy", headers=hdr).json()["policy"] == "replay"
        r = httpx.put(f"{gw}/admin/policy", json={"policy": "libra"}, headers=hdr)
        assert r.status_code == 200 and r.json()["policy"] == "libra"
        r = httpx.put(f"{gw}/admin/policy", json={"policy": "ours"}, headers=hdr)  # old name
        assert r.status_code == 200 and r.json()["policy"] == "progressive"
        assert httpx.put(f"{gw}/admin/policy", json={"policy": "progressive-oracle"},
                         headers=hdr).status_code == 400
        assert httpx.put(f"{gw}/admin/policy", json={"policy": "slime"}).status_code == 401
        assert call(99) == 200


class _Spy:
    """Wraps a policy; records every view ``observe`` is given."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.seen: list[tuple[str, tuple[str, ...], str]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def observe(self, traj, groups, now) -> None:  # type: ignore[no-untyped-def]
        self.seen.append((traj.id, traj.outcomes, traj.phase.value))
        self.inner.observe(traj, groups, now)  # type: ignore[attr-defined]


def test_policy_learns_tool_results_when_the_call_arrives_and_at_finish():
    """The relay hands each arriving call's parsed tool results to the scheduler, which
    lets the policy observe them before the call is queued (as the simulator does when
    a tool gap ends); the final observe still sees the outcomes."""
    from gateway.trajectories.tools import ToolOutcome

    sched, _, tracker = _scheduler()
    spy = _Spy(sched.policy)
    sched.policy = spy  # type: ignore[assignment]
    st = tracker.touch("t", "g", time.time())
    tracker.call_arrived(st, [], time.time())
    sched.call_arrived(st)
    result = ToolOutcome("bash", 900, "medium", "failure")
    tracker.call_arrived(st, [result], time.time())
    sched.call_arrived(st)
    assert spy.seen[-1][:2] == ("t", (result.state,))
    tracker.finish("t", 1.0, time.time())
    sched.trajectory_finished(st)
    assert spy.seen[-1] == ("t", (result.state,), "finished")
