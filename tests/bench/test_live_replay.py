"""``replay`` live: the speeds it plans with are measured from the engines, and the managed
pool's layout follows them.

Two managed sim pools start with the same mixed layout (TP1, TP1, TP2) and the same
profile in the gateway (qwen3-14b/H100, which scales TP well). In one the engines run as
the profile says; in the other they run TP2 far slower (:data:`SLOW_TP2`). The calls are
not streamed, so the gateway times them by the engines' decode clock (the simulated
server keeps vLLM's inter-token latency histogram), which holds none of the host's time
per call: the slow pool measures TP1 at 1.000 the profile and TP2 near 4.85, at the
pool's 20x compression and on a loaded machine alike. Each serves one batch through the
real gateway and the emulated harness; once the pool is idle the policy relays it out
for the next step. It must measure the slow TP2, show that on ``/status``, and choose
differently: no TP above 1 where TP2 was slow.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from bench.harness.batch import HarnessConfig, run_batch
from bench.harness.hosting import free_port, serve_gateway, sim_pool_spec, wait_routable
from bench.workloads import generate
from gateway.config import DispatchSettings, ServerSettings, Settings, TraceSettings

MODEL, SPEED, SEED = "qwen3-14b", 20.0, 1
#: the slow pool's engines: TP2's fixed and per-token step costs x13 (TP4's x25)
SLOW_TP2: dict[str, Any] = {"tp_penalty": 12.0}


def _pool_gateway(tmp_path: Path, engine_options: dict[str, Any]) -> Settings:
    """A gateway running ``replay`` on a managed sim pool (TP1, TP1, TP2) whose engines
    take ``engine_options``; the profile it believes is always the honest one."""
    spec = sim_pool_spec(tmp_path / "pool.json", [1, 1, 2], model=MODEL, gpu="H100",
                         speed=SPEED, seed=SEED)
    doc = json.loads(spec.read_text())
    doc["launcher"]["options"] = engine_options
    spec.write_text(json.dumps(doc))
    return Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'traces.db'}", policy="replay",
        pool=spec, server=ServerSettings(host="127.0.0.1", port=free_port()),
        dispatch=DispatchSettings(speed_profile=f"{MODEL}/H100", tick_s=0.05,
                                  time_scale=SPEED),
        traces=TraceSettings(flush_interval_s=0.05, spool_path=tmp_path / "spool"))


async def _one_step_then_layout(tmp_path: Path, engine_options: dict[str, Any]
                                ) -> tuple[dict[str, Any], list[int]]:
    tmp_path.mkdir()
    settings = _pool_gateway(tmp_path, engine_options)
    specs = generate("swe", SEED, prompts=3, group_size=4, max_context=32768)
    async with serve_gateway(settings) as gw, httpx.AsyncClient(timeout=60) as http:
        await wait_routable(http, gw, 3)
        batch = await run_batch(specs, HarnessConfig(gw, MODEL, speed=SPEED, seed=SEED,
                                                     stream=False, reward_latency=False))
        assert batch.errors == 0
        speeds = (await http.get(f"{gw}/status")).json()["speeds"]
        for _ in range(300):  # the idle pool is relaid out for the next step
            status = (await http.get(f"{gw}/status")).json()
            rl = status["relayouts"]
            done = [r for r in rl["recent"] if r["status"] == "succeeded"]
            if done and all(b["routable"] for b in status["backends"]):
                return speeds, sorted(b["tp"] for b in status["backends"])
            await asyncio.sleep(0.1)
        raise AssertionError(f"no relayout applied: {status['relayouts']}")


def _row(speeds: dict[str, Any], tp: int) -> dict[str, Any]:
    return next(r for r in speeds["by_tp"] if r["tp"] == tp)


async def test_the_layout_follows_the_speeds_the_engines_show(tmp_path: Path) -> None:
    honest, honest_layout = await _one_step_then_layout(tmp_path / "a", {})
    slow, slow_layout = await _one_step_then_layout(tmp_path / "b", SLOW_TP2)
    # both measured TP1 and TP2 from their own calls; TP4 and TP8 only inferred, on their trend
    for sp in (honest, slow):
        assert _row(sp, 1)["source"] == _row(sp, 2)["source"] == "measured"
        assert _row(sp, 4)["source"] == "on the trend of TP1 and TP2"
        assert sp["profile"] == f"{MODEL}/H100"
    # against the profile, slow TP2 is measured far slower relative to TP1 than honest TP2
    # (both factors also hold the gateway's own share of a call, which moves with the load
    # of the machine running the test: only the comparison is asserted)
    ratio = {name: _row(sp, 2)["factor"] / _row(sp, 1)["factor"]
             for name, sp in (("honest", honest), ("slow", slow))}
    assert ratio["slow"] > 1.5 * ratio["honest"], ratio
    # so the next step's layout differs: TP above 1 where it is fast, none where it is slow
    assert sum(honest_layout) == sum(slow_layout) == 4
    assert max(honest_layout) > 1, honest_layout
    assert slow_layout == [1, 1, 1, 1], slow_layout


async def test_a_pool_that_never_idles_is_relaid_out_at_a_weight_push(tmp_path: Path) -> None:
    """The step modes past the barrier (async, carried groups) never leave the pool idle,
    so ``plan`` never relays it out; ``replay`` does it at a weight push instead, where
    the engines pause anyway. A batch runs on the slow-TP2 pool; once some trajectories
    have finished and both degrees are measured, a weight update arrives while the rest
    still run: the push relays the pool out to what was measured fastest (no TP2), and
    every trajectory finishes, the ones in flight on the new instances."""
    from tests.pool.test_weights import checkpoint
    from tests.pool.workload import wait_job

    settings = _pool_gateway(tmp_path, SLOW_TP2)
    specs = generate("swe", SEED, prompts=4, group_size=4, max_context=32768)
    async with serve_gateway(settings) as gw, httpx.AsyncClient(base_url=gw,
                                                                timeout=60) as http:
        await wait_routable(http, gw, 3)
        batch = asyncio.create_task(run_batch(specs, HarnessConfig(
            gw, MODEL, speed=SPEED, seed=SEED, stream=False, reward_latency=False)))
        for _ in range(1200):
            status = (await http.get(f"{gw}/status")).json()
            phases = status["trajectories"]["by_phase"]
            sources = {r["tp"]: r["source"] for r in status["speeds"]["by_tp"]}
            if (phases.get("finished", 0) >= 4 and sources[1] == sources[2] == "measured"):
                break
            assert not batch.done(), "the batch ended before the push"
            await asyncio.sleep(0.1)
        running = len(specs) - phases.get("finished", 0)
        assert running > 0 and status["relayouts"]["applied"] == 0
        r = await http.post(f"{gw}/admin/weight-update", json={
            "version": "1", "method": "reload", "weights_path": checkpoint(tmp_path, "w1")})
        assert r.status_code == 202, r.text
        update = await wait_job(http, r.json()["job"], 120)
        assert update["status"] == "succeeded", update
        moved = update["plan"]["relayout"]
        assert moved["reason"].startswith("replay at the weight push"), moved
        assert sorted(moved["launch"]) == [1, 1, 1, 1], moved
        assert sorted(moved["retire"]) == ["tp1-g0", "tp1-g1", "tp2-g2-3"], moved
        assert (await wait_job(http, moved["job"], 120))["status"] == "succeeded"
        result = await batch
        assert result.errors == 0
        backends = (await http.get(f"{gw}/status")).json()["backends"]
    assert sorted(b["tp"] for b in backends) == [1, 1, 1, 1]
    # the two TP1s already in place are kept, and serve again (the push had drained them)
    assert all(b["routable"] and b["state"] == "ready" for b in backends), backends



async def test_async_steps_relay_a_never_idle_pool_out_at_their_weight_pushes(
        tmp_path: Path) -> None:
    """The client's asynchronous step mode on the slow-TP2 pool, as a trainer runs it:
    groups keep starting while it trains, and after each batch it pushes new weights
    (a reload, abort-and-continue). The pool is never idle, so ``replay`` relays it out
    at a push, of its own accord, once it has measured TP2 slow: it ends without a TP2,
    every instance serving. Every batch is whole groups whose trained tokens are at most
    one version stale, and the calls the bound cut mid-push got their 409."""
    from openai import AsyncOpenAI

    from gateway.client import AsyncRolloutClient, StepMode, StepRunner
    from tests.pool.test_weights import checkpoint
    from tests.pool.workload import wait_job

    settings = _pool_gateway(tmp_path, SLOW_TP2)

    def prompts() -> Any:
        k = 0
        while True:  # every third one a straggler
            yield {"id": k, "tokens": 160 if k % 3 == 2 else 40}
            k += 1

    async with serve_gateway(settings) as gw, httpx.AsyncClient(base_url=gw,
                                                                timeout=60) as http:
        await wait_routable(http, gw, 3)

        async def launch(tid: str, gid: str, prompt: dict[str, int]) -> float:
            messages: list[Any] = [{"role": "user", "content": f"task {prompt['id']}"}]
            async with AsyncOpenAI(base_url=f"{gw}/g/{gid}/t/{tid}/v1", api_key="none",
                                   max_retries=0) as llm:
                for turn in range(3):
                    r = await llm.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=prompt["tokens"],
                        extra_body={"ignore_eos": True})
                    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                                 {"role": "user", "content": f"tool said {turn}"}]
            return 1.0

        batches, pushes = [], []
        async with AsyncRolloutClient(gw) as client, StepRunner(
                client, launch, prompts(), batch=3, group_size=3,
                mode=StepMode("async", max_staleness=1), run_id="live-async") as steps:
            for step in range(5):
                batches.append(await steps.next_batch(timeout_s=300))
                for _ in range(600):  # the first push once TP1 and TP2 are measured (a
                    # call is timed at the scrape after it; step 1 can end before that)
                    rows = (await http.get("/status")).json()["speeds"]["by_tp"]
                    if all(r["source"] == "measured" for r in rows if r["tp"] <= 2):
                        break
                    await asyncio.sleep(0.1)
                job = await client.update_weights(
                    str(step + 1), weights_path=checkpoint(tmp_path, f"w{step + 1}"),
                    mode="abort-and-continue", timeout_s=300)
                assert job.status == "succeeded", job
                pushes.append(job.raw)
        for p in pushes:  # a relayout goes on as a job of its own after its push
            if (p.get("plan") or {}).get("relayout"):
                done = await wait_job(http, p["plan"]["relayout"]["job"], 120)
                assert done["status"] == "succeeded", done
        status = (await http.get("/status")).json()
    moved = [p["plan"]["relayout"] for p in pushes if (p.get("plan") or {}).get("relayout")]
    # at a push, of its own accord: to what the trajectories since the last push ran
    # fastest on (or, where a borrowed factor put it near, to measure TP4 once); never to
    # the TP2 it measured slow, and it ends on the four TP1s that are fastest here
    assert moved and all(m["reason"].startswith("replay") for m in moved), moved
    assert all(2 not in m["launch"] for m in moved), moved
    assert all(b["routable"] and b["state"] == "ready" for b in status["backends"]), moved
    assert sorted(b["tp"] for b in status["backends"]) == [1, 1, 1, 1], moved
    # the trajectories the bound aborted mid-push got their 409 (the runner restarted
    # them), none a scheduler fault
    assert status["scheduler"]["faults"] == 0
    for k, batch in enumerate(batches, start=1):
        assert len(batch.groups) == 3 and all(len(t) == 3 for t in batch.groups.values())
        assert batch.max_staleness <= 1, (k, batch.lag_tokens)
        assert sum(batch.lag_tokens.values()) == sum(sum(s.loss_mask) for s in batch.samples)
