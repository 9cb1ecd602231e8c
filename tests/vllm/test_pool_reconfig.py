"""Acceptance: a managed pool of real vLLM servers (CPU build, tiny model) reconfigured
from two TP1 instances to one TP2 instance and back while a multi-turn workload runs.

On this machine the "GPUs" are the two CPU cores. No client call may fail: while no
instance is ready the gateway holds calls (``DispatchSettings.backend_wait_s``), and
every call's trace must record the TP degree of the instance that served it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from tests.pool.conftest import ADMIN, Gateway, pool_settings
from tests.pool.workload import Tally, calls_of, trajectory, wait_job
from tests.servers import LoopThread, app_in_thread
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
TWO_TP1 = [{"tp": 1, "gpus": [0]}, {"tp": 1, "gpus": [1]}]
ONE_TP2 = [{"tp": 2, "gpus": [0, 1]}]


def vllm_spec(python: str, model_dir: Path, log_dir: Path) -> dict[str, Any]:
    return {
        "model": SERVED_NAME, "inventory": {"gpus": [0, 1]},
        "launcher": {"kind": "vllm", "python": python, "model_path": str(model_dir),
                     "device": "cpu", "start_timeout_s": 240, "log_dir": str(log_dir),
                     "extra_args": ["--dtype", "bfloat16", "--max-model-len", "2048",
                                    "--enforce-eager"]},
        "layout": TWO_TP1, "drain_timeout_s": 120,
    }


@contextmanager
def vllm_pool_gateway(spec: dict[str, Any], tmp_path: Path,
                      sqlite_url: str) -> Iterator[Gateway]:
    loop = LoopThread()
    try:
        path = tmp_path / "pool.yaml"
        path.write_text(json.dumps(spec))  # JSON is YAML: exercises the YAML reader
        app = create_app(pool_settings(path, sqlite_url, backend_wait_s=300))
        with app_in_thread(loop, lambda: app) as url:
            yield Gateway(url, app, loop)
    finally:
        loop.stop()


async def _reconfigure(c: httpx.AsyncClient, layout: list[dict[str, Any]]) -> dict[str, Any]:
    r = await c.put("/admin/pool", json={"layout": layout}, headers=ADMIN)
    assert r.status_code == 202, r.text
    job = await wait_job(c, r.json()["job"], 300)
    assert job["status"] == "succeeded", job
    return job


def _summary(job: dict[str, Any]) -> dict[str, Any]:
    return {"total_s": job["duration_s"],
            **{p["name"]: p["duration_s"] for p in job["phases"]},
            "start_s": {k: v for p in job["phases"] for k, v in p.get("start_s", {}).items()}}


async def test_two_tp1_to_one_tp2_and_back_under_traffic(
        vllm_python: str, tiny_model_dir: Path, tmp_path: Path, sqlite_url: str) -> None:
    spec = vllm_spec(vllm_python, tiny_model_dir, tmp_path / "logs")
    gw_cm: AbstractContextManager[Gateway] = vllm_pool_gateway(spec, tmp_path, sqlite_url)
    timings: dict[str, Any] = {}
    with gw_cm as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=400, headers=ADMIN) as c:
            timings["initial 2xTP1"] = _summary(await wait_job(c, "1", 300))
            stop, tally = asyncio.Event(), Tally()
            tasks = [asyncio.create_task(trajectory(c, f"v{i}", SERVED_NAME, stop, tally,
                                                    gap_s=0.2)) for i in range(3)]
            await asyncio.sleep(3)
            t0 = time.monotonic()
            timings["2xTP1 -> 1xTP2"] = _summary(await _reconfigure(c, ONE_TP2))
            await asyncio.sleep(3)
            timings["1xTP2 -> 2xTP1"] = _summary(await _reconfigure(c, TWO_TP1))
            await asyncio.sleep(3)
            stop.set()
            await asyncio.gather(*tasks)
            timings["traffic_s"] = round(time.monotonic() - t0, 1)
            assert tally.failed == []  # (before reading traces: a failed call says why)
            calls = await calls_of(c, tally.trajectories)
    print("reconfiguration times (real vLLM, CPU):", json.dumps(timings, indent=1))
    assert len(calls) == tally.ok
    assert all(call["status"] == "ok" for call in calls)
    by_backend: dict[str, set[int]] = {}
    for call in calls:
        by_backend.setdefault(call["backend_id"], set()).add(call["tp"])
    assert by_backend == {"tp1-g0": {1}, "tp1-g1": {1}, "tp2-g0-1": {2}}, by_backend
