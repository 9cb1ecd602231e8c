"""What the weight-update tests share: two simulated engines slow enough that an answer
spans a pause, the credentials they are called with, and waits on the engines' stats."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from tests.servers import LoopThread

MODEL = "qwen3-14b"
N = 240  # completion tokens per call: long enough to span a pause
ADMIN = {"authorization": "Bearer tok"}
KEY = "harness-key"  # the model calls' credential (the admin token is the trainer's)
HARNESS = {"authorization": f"Bearer {KEY}"}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]


def lora_sim_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two simulated servers (50x) with LoRA on, rank 16 at most, for a fixture to
    ``yield from``."""
    configs = [SimServerConfig(speed=50, seed=i, enable_lora=True, max_lora_rank=16)
               for i in range(2)]
    cm = start_sim_servers(configs)
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


async def update_job(admin: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /admin/weight-update`` and wait for its job to end; the job's JSON."""
    r = await admin.post("/admin/weight-update", json=body)
    assert r.status_code == 202, r.text
    for _ in range(600):
        job: dict[str, Any] = (await admin.get(f"/admin/jobs/{r.json()['job']}")).json()
        if job["status"] not in ("pending", "running"):
            return job
        await asyncio.sleep(0.02)
    raise AssertionError("the update did not end")


def two_slow_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two simulated servers slow enough (5x) that a 240-token answer spans a pause."""
    configs = [SimServerConfig(speed=5, seed=i, tick_real_s=0.005) for i in range(2)]
    cm = start_sim_servers(configs)
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


async def engine_stats(urls: list[str]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as http:
        return [(await http.get(f"{u}/sim/stats")).json() for u in urls]


def served_model(stats: list[dict[str, Any]], call_id: str) -> str:
    """The model an engine ran the call's request on (its own record: ``engine_stats``)."""
    (model,) = [seen["model"] for s in stats for seen in s["requests_seen"]
                if seen["id"] == f"chatcmpl-{call_id}"]
    return str(model)


async def generating(urls: list[str], at_least: int) -> None:
    """Wait until the engines run ``at_least`` requests (a loaded machine is slow)."""
    for _ in range(400):
        if sum(s["running"] for s in await engine_stats(urls)) >= at_least:
            await asyncio.sleep(0.1)  # and have produced some tokens
            return
        await asyncio.sleep(0.025)
    raise AssertionError("the calls never reached the engines")
