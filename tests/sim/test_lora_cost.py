"""What LoRA adapters cost the simulated engine: slower steps, their own KV, loads that
hold the engine loop (``backends.sim.profiles.LoraCost``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from backends.sim.clock import WallClock
from backends.sim.driver import SimEngine
from backends.sim.engine import EngineCore
from backends.sim.profiles import LoraCost, load_profile
from backends.sim.request import SimRequest
from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from backends.tinylora import write_adapter

P14 = load_profile("qwen3-14b", "H100", 1)
COST = LoraCost()


def _batch_time(engine: EngineCore, adapters: list[str | None], *, fused: bool) -> float:
    for i, lora in enumerate(adapters):
        engine.add_request(SimRequest(f"r{i}", [i * 10_000 + t for t in range(300)], 200,
                                      ignore_eos=True, lora=lora))
    t = 0.0
    while engine.has_work:
        t += engine.step(horizon_s=1.0 if fused else 0.0).duration_s
    return t


@pytest.mark.parametrize("fused", [False, True])
def test_a_batch_on_adapters_takes_the_published_overhead_longer(fused: bool) -> None:
    base = _batch_time(EngineCore(P14), [None] * 8, fused=fused)
    on = EngineCore(P14, lora=COST)
    assert _batch_time(on, [None] * 8, fused=fused) == pytest.approx(
        base * (1 + COST.idle_overhead))  # --enable-lora with no adapter in the batch
    lora = _batch_time(EngineCore(P14, lora=COST), ["a"] * 8, fused=fused)
    assert lora == pytest.approx(base * (1 + COST.idle_overhead + COST.step_overhead))
    half = _batch_time(EngineCore(P14, lora=COST), ["a", None] * 4, fused=fused)
    assert half == pytest.approx(base * (1 + COST.idle_overhead + COST.step_overhead / 2))
    # an engine without --enable-lora never pays: the cost belongs to the engine's option
    assert _batch_time(EngineCore(P14), ["a"] * 8, fused=fused) == pytest.approx(base)


def test_an_adapter_does_not_reuse_the_base_models_kv() -> None:
    """vLLM keys a block's hash by the LoRA too: the same prompt on an adapter is a miss."""
    engine = EngineCore(P14, lora=COST)
    prompt = list(range(512))

    def hits(rid: str, lora: str | None) -> int:
        before = engine.kv.hits
        engine.add_request(SimRequest(rid, prompt, 1, ignore_eos=True, lora=lora))
        while engine.has_work:
            engine.step()
        return engine.kv.hits - before

    assert hits("base", None) == 0
    assert hits("on-a", "a") == 0
    assert hits("on-b", "b") == 0
    assert hits("base-again", None) == 496  # every full block but the last
    assert hits("on-a-again", "a") == 496


async def test_a_load_holds_the_engine_between_two_batches(tmp_path: Path) -> None:
    """A request decoding while an adapter loads is late by the load's time, and the
    load answers only once it is done, as vLLM's ``add_lora`` on the engine core."""
    load_s, speed = 2.0, 10.0
    config = SimServerConfig(enable_lora=True, speed=speed, tick_real_s=0.005,
                             lora_cost=LoraCost(load_s=load_s))
    path = str(write_adapter(tmp_path / "x", seed=5))
    body = {"model": "qwen3-14b", "prompt": "hello", "max_tokens": 600, "ignore_eos": True}
    async with start_sim_servers([config]) as urls, \
            httpx.AsyncClient(base_url=urls[0], timeout=30) as http:
        t0 = time.monotonic()
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        alone = time.monotonic() - t0

        t0 = time.monotonic()
        call = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(alone / 4)
        t_load = time.monotonic()
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path})
        took = time.monotonic() - t_load
        assert r.status_code == 200
        assert (await call).status_code == 200
        held = time.monotonic() - t0
        assert took >= load_s / speed
        assert held - alone >= 0.8 * load_s / speed
        assert (await http.get("/sim/stats")).json()["held_s"] == pytest.approx(load_s)


async def test_a_pause_during_a_load_holds_the_engine_after_it() -> None:
    """A pause that comes while a load holds the loop: no batch runs after the load
    until the resume (the loop looks again once it has the engine)."""
    core = EngineCore(P14)
    engine = SimEngine(core, WallClock(10.0), tick_s=0.2)
    loop = asyncio.create_task(engine.run())
    try:
        handle = await engine.submit(SimRequest("r", list(range(100)), 2000, ignore_eos=True,
                                                output_ids=list(range(2000))))
        await asyncio.sleep(0.05)
        load = asyncio.create_task(engine.hold(2.0))  # 0.2 s of real time
        await asyncio.sleep(0.03)  # the loop waits for the engine behind the load
        engine.pause()
        await engine.settled()
        before = handle.num_generated
        await asyncio.sleep(0.4)
        assert load.done() and handle.num_generated == before
        engine.resume()
        await asyncio.sleep(0.1)
        assert handle.num_generated > before
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
