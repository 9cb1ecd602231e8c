"""A gateway restarted over engines that outlived it (static backends) serves and stamps
what the engines hold: their weight version, and the LoRA adapters loaded on them.

Before, a restarted gateway stamped every call with its configured version ("0") while
the engines served version 5, and forgot the adapters: a call for a LoRA family ran on
the base weights (or was a 404), recorded as the base's version."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.tinylora import write_adapter
from tests.gateway.conftest import GatewayFactory
from tests.gateway.slow_engines import (
    ADMIN,
    HARNESS,
    KEY,
    MODEL,
    engine_stats,
    lora_sim_engines,
    served_model,
    update_job,
)
from tests.gateway.test_weight_updates import checkpoint
from tests.servers import LoopThread


@pytest.fixture
def lora_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    yield from lora_sim_engines(loop_thread)  # fresh: the test restarts a gateway on them


async def _update(admin: httpx.AsyncClient, body: dict[str, Any]) -> None:
    job = await update_job(admin, body)
    assert job["status"] == "succeeded", job


async def _chat(http: httpx.AsyncClient, tid: str, model: str) -> httpx.Response:
    return await http.post(f"/t/{tid}/v1/chat/completions", json={
        "model": model, "max_tokens": 6, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"hello from {tid}"}]})


async def test_a_restarted_gateway_serves_and_stamps_what_the_engines_hold(
        lora_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    adapters = {v: str(write_adapter(tmp_path / f"a{v}", seed=v)) for v in (3, 4)}
    with gateway_at(sqlite_url, lora_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin:
            await _update(admin, {"version": "5", "method": "reload",
                                  "weights_path": checkpoint(tmp_path, "ckpt5")})
            for v in (3, 4):
                await _update(admin, {"version": str(v), "method": "lora", "model": "verifier",
                                      "lora_path": adapters[v]})
    # the gateway is gone; the engines still serve version 5 and hold verifier@lora-3, -4,
    # but the second lost -4 (restarted, say): whichever the new gateway reads first, it
    # takes the newest adapter and gives it to the engine that lacks it
    async with httpx.AsyncClient(timeout=10) as raw:
        r = await raw.post(f"{lora_engines[1]}/v1/unload_lora_adapter",
                           json={"lora_name": "verifier@lora-4"})
        assert r.status_code == 200, r.text
    with gateway_at(sqlite_url, lora_engines, keep_engines=True, admin_token="tok",
                    api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            for tid, model in (("after-base", MODEL), ("after-verifier", "verifier")):
                r = await _chat(http, tid, model)
                assert r.status_code == 200, r.text
            answers = await asyncio.gather(*(_chat(http, f"v{i}", "verifier")
                                             for i in range(6)))
            assert [r.status_code for r in answers] == [200] * 6
            stats = await engine_stats(lora_engines)
            assert all(any(seen["model"] == "verifier@lora-4" for seen in st["requests_seen"])
                       for st in stats)  # both engines ran the adapter
            async with httpx.AsyncClient(timeout=10) as raw:
                for engine in lora_engines:
                    cards = (await raw.get(f"{engine}/v1/models")).json()["data"]
                    assert "verifier@lora-4" in {c["id"] for c in cards}
            for i in range(6):
                (call,) = (await admin.get(f"/trajectories/v{i}")).json()["calls"]
                assert call["weight_version"] == "4"
                assert served_model(stats, call["id"]) == "verifier@lora-4"
            (base,) = (await admin.get("/trajectories/after-base")).json()["calls"]
            (verifier,) = (await admin.get("/trajectories/after-verifier")).json()["calls"]
            assert (base["model"], base["weight_version"]) == (MODEL, "5")
            assert served_model(stats, base["id"]) == MODEL
            assert (verifier["model"], verifier["weight_version"]) == ("verifier", "4")
            assert served_model(stats, verifier["id"]) == "verifier@lora-4"
            status = (await admin.get("/status")).json()
            assert status["weight_version"] == "5"
            assert status["models"]["verifier"]["adapter"] == "verifier@lora-4"
            assert status["models"]["verifier"]["version"] == "4"
