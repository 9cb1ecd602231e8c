"""``replay`` on a managed pool of real vLLM engines (CPU build, tiny model) whose TP scaling
is nothing like the profile the gateway starts from.

The gateway believes qwen3-14b on H100s, where one TP2 instance decodes a small batch
nearly twice as fast as a TP1 and so serves it sooner than two TP1s. Here the "GPUs" are
the two CPU cores: a TP2 engine splits a tiny model over them and pays an all-reduce a
layer, its per-step overhead undivided, so two TP1 engines can serve a batch faster. The pool
starts on the probe layout (two GPUs hold one TP1 each) or on one TP2, runs a batch, is
relaid out by the policy when idle, and so on for a few steps. Both layouts must have run
(measured, not assumed), and the layout it ends on must be the one that ran the batch
faster in this very run or one that served within 10% of it.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.harness.batch import HarnessConfig, run_batch
from bench.harness.hosting import free_port, serve_gateway, wait_routable
from bench.runners.vllm_cpu import tiny_long_tail
from gateway.config import DispatchSettings, ServerSettings, Settings, TraceSettings
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 3
NEAR = 1.1  # a layout within this factor of the fastest measured is as good


async def _settled_layout(http: httpx.AsyncClient, gw: str, applied: int, quiet_s: float = 10
                          ) -> tuple[int, list[int], list[dict[str, Any]]]:
    """Once a batch is over, wait for the idle pool to take the policy's next layout, or for
    ``quiet_s`` with none proposed (the policy plans every 2 s): (relayouts applied so far,
    TPs of the backends, the relayouts' records)."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + 300:
        status = (await http.get(f"{gw}/status")).json()
        rl, backends = status["relayouts"], status["backends"]
        assert rl["failed"] == 0, rl
        ready = rl["in_progress"] == 0 and all(b["routable"] for b in backends)
        if ready and (rl["applied"] > applied or time.monotonic() > t0 + quiet_s):
            return rl["applied"], sorted(b["tp"] for b in backends), rl["recent"]
        await asyncio.sleep(0.2)
    raise AssertionError(f"the pool did not settle: {status['relayouts']}")


@pytest.mark.parametrize("start", ["probe", "tp2"])
async def test_the_pool_ends_on_the_layout_that_served_faster(
        start: str, vllm_python: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """``probe``: two TP1s, the profile's TP2 tried next on its merit. ``tp2``: one TP2,
    the profile's own first choice, whose measured factor lent to TP1 keeps TP2 first (by
    1.3x, inside the 1.6x margin): TP1 is run once to be measured. From either it must end
    on the faster. (Both are ``slow``, out of ``make test``: each takes 4-5 minutes of
    engine restarts, and CI's time limit is near; ``tests/bench/test_live_replay.py``
    runs the same policy on a managed sim pool in the default run.)"""
    spec = {
        "model": SERVED_NAME, "inventory": {"gpus": [0, 1]},
        "launcher": {"kind": "vllm", "python": vllm_python, "model_path": str(tiny_model_dir),
                     "device": "cpu", "start_timeout_s": 240, "log_dir": str(tmp_path / "logs"),
                     "extra_args": ["--dtype", "bfloat16", "--max-model-len", "2048",
                                    "--enforce-eager"]},
        "layout": "probe" if start == "probe" else [{"tp": 2, "gpus": [0, 1]}],
        "drain_timeout_s": 120,
    }
    (tmp_path / "pool.json").write_text(json.dumps(spec))
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'traces.db'}", policy="replay",
        pool=tmp_path / "pool.json",
        server=ServerSettings(host="127.0.0.1", port=free_port()),
        dispatch=DispatchSettings(speed_profile="qwen3-14b/H100", tick_s=0.05,
                                  backend_wait_s=300),
        traces=TraceSettings(flush_interval_s=0.05, spool_path=tmp_path / "spool"))
    specs = tiny_long_tail(1, prompts=3, group_size=4)
    steps: list[tuple[list[int], float]] = []  # (layout, makespan) per step
    clocks: list[list[float] | None] = []  # each engine's decode clock after each step
    async with serve_gateway(settings) as gw, httpx.AsyncClient(timeout=120) as http:
        await wait_routable(http, gw, 2 if start == "probe" else 1, timeout_s=300)
        layout = sorted(b["tp"] for b in (await http.get(f"{gw}/status")).json()["backends"])
        assert layout == ([1, 1] if start == "probe" else [2])  # the probe of two GPUs: TP1s
        async with httpx.AsyncClient(timeout=120) as warm:  # first calls compile kernels
            await warm.post(f"{gw}/v1/chat/completions", json={
                "model": SERVED_NAME, "max_tokens": 4,
                "messages": [{"role": "user", "content": "warm up"}]})
        applied = 0
        for _ in range(STEPS):
            batch = await run_batch(specs, HarnessConfig(gw, SERVED_NAME, seed=1,
                                                         stream=False, reward_latency=False))
            assert batch.errors == 0
            steps.append((layout, batch.makespan_s))
            clocks += [b["decode_clock"] for b in (await http.get(f"{gw}/status")).json()[
                "backends"]]
            applied, layout, relayouts = await _settled_layout(http, gw, applied)
        speeds = (await http.get(f"{gw}/status")).json()["speeds"]
    # the meter timed these calls (not streamed) by the engines' own decode clock, which
    # real vLLM reports (its inter-token latency), read at every scrape
    assert all(c is not None and c[1] > 0 for c in clocks), clocks
    print("steps (layout, makespan s):", steps, "then", layout)
    print("relayouts:", [(r["launch"], r["reason"], r["duration_s"]) for r in relayouts])
    print("speeds:", json.dumps(speeds["by_tp"]))
    by_layout: dict[tuple[int, ...], list[float]] = {}
    for lay, s in steps:
        by_layout.setdefault(tuple(lay), []).append(s)
    # both layouts ran a batch: TP2 was measured, not inferred, before it was judged
    assert set(by_layout) == {(1, 1), (2,)}, steps
    rows = {r["tp"]: r for r in speeds["by_tp"]}
    assert rows[1]["source"] == rows[2]["source"] == "measured"
    if start == "tp2":  # TP1 was run to be measured, not judged on its borrowed estimate
        assert "measuring TP1" in relayouts[0]["reason"], relayouts
    # the layout it ends on served within NEAR of the faster one in this run: where the two
    # differ by more, that is the faster; on two shared cores they can also tie (a CI run
    # measured 18.4 s for two TP1s against 19.7 s for the TP2 it started on), and then
    # either is right
    fastest = min(min(v) for v in by_layout.values())
    assert min(by_layout[tuple(layout)]) <= NEAR * fastest, (steps, layout)
