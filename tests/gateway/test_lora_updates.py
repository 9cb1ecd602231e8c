"""LoRA adapters as weight updates, on simulated vLLM servers with ``enable_lora``.

``POST /admin/weight-update`` with ``method: "lora"`` loads an adapter on every engine
and makes it what calls on the base model run on, with no pause: a call that started
on the previous adapter finishes on it and is stamped with its version (the engines'
own record of which adapter served each request is the truth), new calls get the new
one, the ``keep`` most recent stay loaded, a refusal by one engine is rolled back on the
others, and a check that fails is a 400/409 that loads nothing. The same on real vLLM:
tests/vllm/test_lora_vllm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.runner import start_sim_servers
from backends.sim.state import SimServerConfig
from backends.tinylora import write_adapter
from tests.gateway.conftest import GatewayFactory
from tests.gateway.slow_engines import (
    ADMIN,
    HARNESS,
    KEY,
    MODEL,
    engine_stats,
    generating,
    served_model,
    update_job,
)
from tests.servers import LoopThread


@pytest.fixture
def lora_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    """Two slow simulated servers with LoRA on; the second takes rank 8 at most. Fresh
    for each test: a gateway takes over the adapters engines hold (gateway.weights.adopt),
    so one test's adapters would be the next one's starting point."""
    configs = [SimServerConfig(speed=5, seed=i, tick_real_s=0.005, enable_lora=True,
                               max_lora_rank=16 if i == 0 else 8) for i in range(2)]
    cm = start_sim_servers(configs)
    urls = loop_thread.run(cm.__aenter__())
    yield urls
    loop_thread.run(cm.__aexit__(None, None, None))


_job = update_job


async def _call(http: httpx.AsyncClient, tid: str, tokens: int = 8) -> dict[str, Any]:
    r = await http.post("/v1/chat/completions", headers={"x-trajectory-id": tid}, json={
        "model": MODEL, "max_tokens": tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": f"hello from {tid}"}]})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _stamp(admin: httpx.AsyncClient, tid: str) -> dict[str, Any]:
    (call,) = (await admin.get(f"/trajectories/{tid}")).json()["calls"]
    return dict(call)


async def test_an_adapter_update_pauses_nothing_and_stamps_each_call_with_its_adapter(
        lora_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    adapters = {v: str(write_adapter(tmp_path / f"a{v}", seed=v)) for v in (1, 2, 3)}
    with gateway_at(sqlite_url, lora_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            await admin.put("/admin/staleness", json={"max_staleness": 1})  # keep 2
            job = await _job(admin, {"version": "1", "method": "lora",
                                     "lora_path": adapters[1]})
            assert job["status"] == "succeeded", job
            assert [p["name"] for p in job["phases"]] == ["check", "load", "switch"]
            pauses = sum(s["pauses"] for s in await engine_stats(lora_engines))

            # a long call on adapter 1, running while adapter 2 arrives
            long = asyncio.create_task(_call(http, "long", tokens=240))
            await generating(lora_engines, 1)
            job = await _job(admin, {"version": "2", "method": "lora",
                                     "lora_path": adapters[2]})
            assert job["status"] == "succeeded", job
            assert not long.done()  # nothing paused or cut it
            short = await _call(http, "after-2")
            answer = await long
            assert answer["choices"][0]["finish_reason"] == "length"
            assert len(answer["choices"][0]["message"]["content"]) > 0
            assert short["model"] == f"{MODEL}@lora-2"

            job = await _job(admin, {"version": "3", "method": "lora",
                                     "lora_path": adapters[3]})
            assert job["status"] == "succeeded", job
            assert job["phases"][-1]["name"] == "unload"  # adapter 1: past keep 2
            stats = await engine_stats(lora_engines)
            assert sum(s["pauses"] for s in stats) == pauses  # no engine was paused
            assert [s["adapters"] for s in stats] == [[f"{MODEL}@lora-2",
                                                       f"{MODEL}@lora-3"]] * 2
            for tid, version in (("long", "1"), ("after-2", "2")):
                call = await _stamp(admin, tid)
                assert call["weight_version"] == version, (tid, call["weight_version"])
                assert call["model"] == MODEL  # recorded as the policy's base model
                assert served_model(stats, call["id"]) == f"{MODEL}@lora-{version}"
            sample = (await admin.get("/trajectories/long/sample")).json()
            assert set(sample["weight_versions"][-240:]) == {"1"}
            status = (await admin.get("/status")).json()
            assert status["weight_version"] == "3"
            assert status["adapters"][MODEL]["current"]["name"] == f"{MODEL}@lora-3"
            assert status["adapters"][MODEL]["loaded"] == ["2", "3"]


async def test_a_refused_adapter_is_rolled_back_and_a_bad_one_is_400(
        lora_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    ok = str(write_adapter(tmp_path / "ok", seed=1))
    rank16 = str(write_adapter(tmp_path / "r16", seed=2, rank=16))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    with gateway_at(sqlite_url, lora_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            before = [s["adapter_loads"] for s in await engine_stats(lora_engines)]
            for body, status, says in (
                    ({"lora_path": "relative/dir"}, 400, "not absolute"),
                    ({"lora_path": str(tmp_path / "none")}, 400, "does not exist"),
                    ({"lora_path": str(broken)}, 400, "'r' must be a positive integer"),
                    ({}, 400, "needs 'lora_path'"),
                    ({"lora_path": ok, "base_model": "other"}, 409, "is not served")):
                r = await admin.post("/admin/weight-update",
                                     json={"version": "7", "method": "lora", **body})
                assert r.status_code == status and says in r.text, (body, r.text)
            r = await admin.post("/admin/weight-update?dry_run=true",
                                 json={"version": "7", "method": "lora", "lora_path": ok})
            assert r.status_code == 200, r.text
            assert r.json()["adapter"]["name"] == f"{MODEL}@lora-7"
            assert [s["adapter_loads"] for s in await engine_stats(lora_engines)] == before

            job = await _job(admin, {"version": "8", "method": "lora",
                                     "lora_path": rank16})
            assert job["status"] == "failed"
            assert [p["name"] for p in job["phases"]] == ["check", "load", "rollback"]
            assert any("greater than max_lora_rank 8" in e for e in job["errors"])
            stats = await engine_stats(lora_engines)
            assert stats[0]["adapter_loads"] == before[0] + 1  # it took it, then gave it up
            assert all(f"{MODEL}@lora-8" not in s["adapters"] for s in stats)
            answer = await _call(http, "after-refusal")
            assert answer["model"] == MODEL  # still the base model: nothing switched
            assert (await _stamp(admin, "after-refusal"))["weight_version"] != "8"

            job = await _job(admin, {"version": "9", "method": "lora", "lora_path": ok})
            assert job["status"] == "succeeded"
            r = await admin.post("/admin/weight-update",
                                 json={"version": "9", "method": "lora", "lora_path": ok})
            assert r.status_code == 409 and "loaded already" in r.text
            # the base weights may not change under loaded adapters: a call on adapter 9
            # would be stamped 9 whatever weights were under it
            for method, path, body in (
                    ("POST", "/admin/weight-update", {"version": "10"}),
                    ("POST", "/admin/weight-update", {"version": "10", "method": "reload",
                                                      "weights_path": ok}),
                    ("PUT", "/admin/weight-version", {"version": "10"}),
                    ("POST", "/admin/resume", {"weight_version": "10"})):
                r = await admin.request(method, path, json=body)
                assert r.status_code == 409 and "LoRA adapters are loaded" in r.text, r.text
            assert (await admin.get("/status")).json()["weight_version"] == "9"
            assert (await admin.post("/admin/resume", json={})).status_code == 200
