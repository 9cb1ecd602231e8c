"""A real gateway process restarted in the middle of a batch of multi-turn trajectories.

The second process has never seen the trajectories: on the first call of each it restores
the trajectory's state from the store (next ``seq``, last prompt + completion tokens,
group). The test compares every trajectory of the interrupted batch with the same
trajectory run uninterrupted (same prompts, same per-turn sampling ``seed``, so the
simulated engine answers identically): the training samples must be equal, ``seq`` must
continue across the restart, the first prompt after it must be stored as a delta (not
whole at offset 0), and no mismatch may appear.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from tests.reliability.restarts import (
    RESTART_AT,
    TRAJECTORIES,
    TURNS,
    agents,
    check_as_uninterrupted,
    start_gateway,
    stop_gateway,
    turns,
)
from tests.servers import free_port


async def test_restart_mid_batch_continues_every_trajectory_as_if_uninterrupted(
        sim_children, db_url: str, tmp_path: Path) -> None:
    sim = sim_children(speed=50.0)
    port = free_port()
    run = tmp_path.name[-8:]
    cut, ref = agents(run, "cut"), agents(run, "ref")
    first = start_gateway(sim.url, db_url, tmp_path, "first", policy="progressive", port=port,
                          spool="first-spool.jsonl")
    async with httpx.AsyncClient(timeout=60) as http:
        try:
            await turns(http, first.url, cut, RESTART_AT)
        finally:
            await stop_gateway(first, 30)
        second = start_gateway(sim.url, db_url, tmp_path, "second", policy="progressive", port=port,
                               spool="second-spool.jsonl")
        try:
            # after the restart the agents call without the group in the path: the
            # restored state carries it
            await asyncio.gather(turns(http, second.url, cut, TURNS, grouped=False),
                                 turns(http, second.url, ref, TURNS))
            status = await check_as_uninterrupted(http, second.url, cut, ref)
            for a in cut:
                calls = (await http.get(f"{second.url}/trajectories/{a.tid}")).json()["calls"]
                after, before = calls[RESTART_AT], calls[RESTART_AT - 1]
                assert after["prompt_offset"] > 0  # stored as a delta, not whole at 0
                assert after["prompt_offset"] == before["prompt_offset"] + len(
                    before["prompt_delta_ids"]) + len(before["completion_ids"])
            assert status["scheduler"]["faults"] == 0 and status["scheduler"]["queued"] == 0
            # the cut trajectories came back from the store; the new ones were only asked
            # for in batches (at most one query per id, usually far fewer)
            restore = status["restore"]
            assert restore["restored"] == TRAJECTORIES and restore["failures"] == 0
            assert 1 <= restore["existence_queries"] <= 2 * TRAJECTORIES
        finally:
            second.stop()
