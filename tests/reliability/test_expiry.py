"""Trajectories left idle mid-way are forgotten, and go on where they were when they are
called again (gateway/trajectories/expiry.py).

Half the batch stops after ``RESTART_AT`` turns, as harnesses that died or sat in a long
tool would; the gateway forgets them (their memory is freed, the other half is kept).
Then they call again: each is restored from the store as after a restart, and its sample
equals that of the same trajectory run without a pause (same prompts, same seeds), with
``seq`` going on and the next prompt stored as a delta. The expiry is stepped with a fake
clock here rather than waited for.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.config import Settings, TraceSettings, TrajectorySettings, UpstreamSettings
from gateway.trajectories.expiry import Expiry
from tests.reliability.restarts import RESTART_AT, TURNS, agents, check_as_uninterrupted, turns

IDLE_S = 100.0


async def _expire(expiry: Expiry) -> list[str]:
    return expiry.expire()  # on the gateway's loop: the tracker is that loop's


def test_an_expired_trajectory_is_freed_and_its_next_call_goes_on(
        gateway, loop_thread, sim_children, db_url: str) -> None:
    sim = sim_children(speed=50.0)
    settings = Settings(database_url=db_url, backends=[sim.url], policy="replay",
                        upstream=UpstreamSettings(health_interval_s=0.5),
                        traces=TraceSettings(flush_interval_s=0.05))
    run = f"{int(time.time() * 1000) % 10**8}"
    cut, ref = agents(run, "cut"), agents(run, "ref")
    with gateway(settings) as (url, rt):

        async def go() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                await turns(http, url, cut, RESTART_AT)
                cut_end = max(rt.tracker.get(a.tid).last_call_end for a in cut)
                await asyncio.sleep(0.3)
                await turns(http, url, ref, 1)  # the other half is busy: kept
                held = len(rt.tracker)
                expiry = Expiry(rt.tracker, TrajectorySettings(idle_expire_s=IDLE_S),
                                clock=lambda: cut_end + 0.15 + IDLE_S)
                gone = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                    _expire(expiry), loop_thread.loop))
                assert sorted(gone) == sorted(a.tid for a in cut)
                assert len(rt.tracker) == held - len(cut)
                assert not {a.tid for a in cut} & set(rt.tracker.live)
                assert {a.tid for a in ref} <= set(rt.tracker.live)
                restored = rt.restorer.restored
                await asyncio.gather(turns(http, url, cut, TURNS, grouped=False),
                                     turns(http, url, ref, TURNS))
                assert rt.restorer.restored == restored + len(cut)
                status = await check_as_uninterrupted(http, url, cut, ref)
                assert status["scheduler"]["faults"] == 0
                for a in cut:
                    calls = (await http.get(f"{url}/trajectories/{a.tid}")).json()["calls"]
                    after, before = calls[RESTART_AT], calls[RESTART_AT - 1]
                    assert after["prompt_offset"] == before["prompt_offset"] + len(
                        before["prompt_delta_ids"]) + len(before["completion_ids"])

        asyncio.run(go())
