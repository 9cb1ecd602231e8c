"""A TP change proposed by ``progressive`` is applied live on a managed sim pool, losing no call.

The batch runs through the real gateway and the emulated harness (official OpenAI
client), on simulated servers started by the pool's in-process launcher with a simulated
start-up delay; nothing is forced: the policy proposes the merge itself when the batch
enters its tail.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from bench.harness.batch import HarnessConfig, run_batch
from bench.harness.hosting import free_port, serve_gateway, sim_pool_spec, wait_routable
from bench.workloads import generate
from gateway.config import DispatchSettings, ServerSettings, Settings, TraceSettings

MODEL, SPEED, SEED = "qwen3-14b", 40.0, 1


async def _calls(http: httpx.AsyncClient, gw: str, ids: list[str], expected: int) -> list[dict]:
    """Every recorded call, once the trace writer has written them all."""
    for _ in range(100):
        calls = [c for tid in ids
                 for c in (await http.get(f"{gw}/trajectories/{tid}")).json()["calls"]]
        if len(calls) >= expected:
            return calls
        await asyncio.sleep(0.1)
    raise AssertionError(f"{len(calls)} of {expected} calls recorded")


async def test_ours_merges_instances_into_higher_tp_live(tmp_path: Path) -> None:
    specs = generate("swe", SEED, prompts=2, group_size=4, max_context=32768)
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'traces.db'}", policy="progressive",
        pool=sim_pool_spec(tmp_path / "pool.json", [1, 1, 1, 1], model=MODEL, gpu="H100",
                           speed=SPEED, seed=SEED),
        server=ServerSettings(host="127.0.0.1", port=free_port()),
        dispatch=DispatchSettings(speed_profile=f"{MODEL}/H100", tick_s=0.05, time_scale=SPEED),
        traces=TraceSettings(flush_interval_s=0.05, spool_path=tmp_path / "spool"))
    async with serve_gateway(settings) as gw, httpx.AsyncClient(timeout=60) as http:
        await wait_routable(http, gw, 4)
        batch = await run_batch(specs, HarnessConfig(gw, MODEL, speed=SPEED, seed=SEED,
                                                     stream=False, reward_latency=False))
        status = (await http.get(f"{gw}/status")).json()
        turns = sum(len(r.turns) for r in batch.trajectories)
        calls = await _calls(http, gw, [s.id for s in specs], turns)
    assert batch.errors == 0 and status["totals"]["calls_failed"] == 0
    rl = status["relayouts"]
    assert rl["applied"] >= 1, rl
    merge = next(r for r in rl["recent"] if r["status"] == "succeeded")
    assert merge["launch"][0] > 1 and len(merge["retire"]) == merge["launch"][0]
    assert merge["start_s"] * SPEED >= 10.8  # the simulated start-up was paid
    assert all(c["status"] == "ok" for c in calls)
    for c in calls:  # pool instance ids say their TP: tp4-g0-1-2-3
        m = re.match(r"tp(\d+)-g", c["backend_id"])
        assert m is not None and c["tp"] == int(m.group(1)), c
    assert any(c["tp"] == merge["launch"][0] for c in calls), "no call ran on the new instance"
    assert any(b["tp"] == merge["launch"][0] for b in status["backends"])
