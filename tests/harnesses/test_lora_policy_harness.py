"""A harness as shipped, calling a LoRA policy: mini-swe-agent's CLI (base URL, key and
model set, the model being a LoRA family's name) against a gateway whose engines serve
that family's adapter.

What is asserted: every call is recorded under the family's name, stamped with its
adapter's version and run by the engines on that adapter (their own record of what served
each request); the family's main sample trains the conversation the harness kept; the
base model has no sample of it (a 404 that names the models it has).
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.tinylora import write_adapter
from tests.gateway.slow_engines import engine_stats, lora_sim_engines, update_job
from tests.harnesses.mini import rejected_replies, run_mini
from tests.servers import LoopThread

if importlib.util.find_spec("minisweagent") is None:
    pytest.skip("mini-swe-agent is not installed (the dev extra of pyproject.toml brings it: "
                "pip install -e '.[dev]')", allow_module_level=True)

BASE = "qwen3-14b"
STEPS = 6
ADMIN: dict[str, str] = {}  # no credential configured: the harness sends its own "EMPTY"


@pytest.fixture(scope="module")
def lora_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    yield from lora_sim_engines(loop_thread)


def test_mini_swe_agent_on_a_lora_policy(lora_engines: list[str], gateway_at: Any,
                                         sqlite_url: str, tmp_path: Path,
                                         loop_thread: LoopThread) -> None:
    traj = "lora-mini-" + uuid.uuid4().hex[:8]
    adapter = str(write_adapter(tmp_path / "solver-3", seed=3))
    with gateway_at(sqlite_url, lora_engines, lora_models={"solver": BASE}) as gw:
        async def update() -> dict[str, Any]:
            async with httpx.AsyncClient(base_url=gw, timeout=60, headers=ADMIN) as admin:
                return await update_job(admin, {"version": "3", "method": "lora",
                                                "model": "solver", "lora_path": adapter})

        assert loop_thread.run(update())["status"] == "succeeded"
        saved, _ = run_mini(f"{gw}/t/{traj}/v1", tmp_path, steps=STEPS, model="solver")
        get = {"headers": ADMIN, "timeout": 10}
        calls = httpx.get(f"{gw}/trajectories/{traj}", **get).json()["calls"]
        main = httpx.get(f"{gw}/trajectories/{traj}/sample", params={"model": "solver"},
                         **get).json()
        base = httpx.get(f"{gw}/trajectories/{traj}/samples", params={"model": BASE},
                         **get)
        ran = {s["id"]: s["model"] for stats in loop_thread.run(engine_stats(lora_engines))
               for s in stats["requests_seen"]}
    assert saved["info"]["model_stats"]["api_calls"] == STEPS
    assert len(calls) == STEPS and all(c["status"] == "ok" for c in calls)
    assert {(c["model"], c["weight_version"]) for c in calls} == {("solver", "3")}
    # the engines' own record: every call ran on the adapter (vLLM names a chat request
    # chatcmpl-<request_id>, and the gateway sends the call's id)
    assert [ran.get(f"chatcmpl-{c['id']}") for c in calls] == ["solver@lora-3"] * STEPS
    # the family's main sample: the conversation mini-swe-agent kept, every token of
    # every call on it trained, stamped "3"; the base model has no sample of it
    rejected = rejected_replies(saved["messages"])
    kept_tokens = sum(len(c["completion_ids"]) for c, r in zip(calls, rejected, strict=True)
                      if not r)
    assert main["main"] and main["mismatches"] == []
    assert sum(main["loss_mask"]) == kept_tokens > 0
    assert set(main["weight_versions"]) <= {"3", ""}
    assert base.status_code == 404 and "no call for model" in base.text

