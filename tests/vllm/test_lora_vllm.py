"""LoRA adapters as weight updates on real vLLM (CPU build, tiny model, random adapters).

One engine started with ``--enable-lora`` (rank 8, two slots) behind a gateway. Adapters
1, 2 and 3 are loaded one after another by ``POST /admin/weight-update`` with
``method: "lora"``; a call made on each is stamped with its version, and every generated
token's logprob, recomputed under the adapter the call is stamped with, matches the one
the engine reported, while under the other adapters it does not. ``keep: 2`` unloads
adapter 1 when 3 arrives; a rank-16 adapter the engine refuses is rolled back and
changes nothing; a full reload of the base checkpoint is timed beside an adapter update
(printed; ``-s`` shows it), and once adapters are loaded the base weights may not change.
Then a second policy, a ``verifier`` family of the same base, runs beside the base's own:
interleaved in one trajectory and side by side, each policy's trained tokens are true
under the adapter they were stamped with.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.tinylora import write_adapter
from tests.vllm.conftest import own_engine_gateway
from tests.vllm.truth import SERVED_NAME, recompute

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
ADMIN = {"authorization": "Bearer tok"}
#: a token's recomputed logprob within this of the reported one: the same weights made it
SAME = 0.02


async def _job(admin: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await admin.post("/admin/weight-update", json=body)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job: dict[str, Any] = (await admin.get(f"/admin/jobs/{r.json()['job']}")).json()
        if job["status"] not in ("pending", "running"):
            return job
        await asyncio.sleep(0.1)
    raise AssertionError("the update did not end in 300 s")


async def _call(http: httpx.AsyncClient, tid: str) -> dict[str, Any]:
    r = await http.post("/v1/chat/completions", headers={"x-trajectory-id": tid}, json={
        "model": SERVED_NAME, "max_tokens": 24, "ignore_eos": True, "temperature": 1.0,
        "messages": [{"role": "user", "content": f"say something about {tid}"}]})
    assert r.status_code == 200, r.text
    (call,) = (await http.get(f"/trajectories/{tid}")).json()["calls"]
    sample = (await http.get(f"/trajectories/{tid}/sample")).json()
    return {"answer": r.json(), "call": call, "sample": sample}


async def _served(engine: str) -> set[str]:
    async with httpx.AsyncClient(timeout=30) as http:
        return {m["id"] for m in (await http.get(f"{engine}/v1/models")).json()["data"]}


async def test_adapters_are_weight_updates_without_a_pause(
        vllm_python: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    paths = {v: str(write_adapter(tmp_path / f"adapter-{v}", seed=v)) for v in (1, 2, 3)}
    too_big = str(write_adapter(tmp_path / "adapter-r16", seed=9, rank=16))
    async with (own_engine_gateway(vllm_python, tiny_model_dir, tmp_path, "lora",
                                   lora=True) as url,
                httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=120) as http,
                httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=120) as admin):
        engine = (await admin.get("/admin/backends")).json()["data"][0]["url"]
        bad = await admin.post("/admin/weight-update", json={
            "version": "1", "method": "lora", "lora_path": str(tmp_path / "nothing")})
        assert bad.status_code == 400 and "does not exist" in bad.text, bad.text

        # a full reload of the base checkpoint, timed beside the adapter updates below
        job = await _job(admin, {"version": "0", "method": "reload",
                                 "weights_path": str(tiny_model_dir)})
        assert job["status"] == "succeeded", job
        reload_s = job["duration_s"]

        calls = {"base": await _call(http, "on-base")}
        seconds = {}
        for v in (1, 2, 3):
            job = await _job(admin, {"version": str(v), "method": "lora",
                                     "lora_path": paths[v], "keep": 2})
            assert job["status"] == "succeeded", job
            seconds[v] = job["duration_s"]
            calls[str(v)] = await _call(http, f"on-{v}")
            assert calls[str(v)]["call"]["weight_version"] == str(v)
            assert calls[str(v)]["answer"]["model"] == f"{SERVED_NAME}@lora-{v}"
        # keep 2: adapter 1 left the engine when 3 came; 2 and 3 are served
        assert await _served(engine) == {SERVED_NAME, f"{SERVED_NAME}@lora-2",
                                         f"{SERVED_NAME}@lora-3"}

        # the truth: each call's tokens recomputed under its stamped adapter
        for stamped in ("2", "3"):
            sample = calls[stamped]["sample"]
            ids, reported = sample["token_ids"], sample["logprobs"]
            n = len(calls[stamped]["call"]["completion_ids"])
            under = {v: await recompute(engine, ids, f"{SERVED_NAME}@lora-{v}")
                     for v in ("2", "3")}
            under["base"] = await recompute(engine, ids)
            start = len(ids) - n
            for i in range(start, len(ids)):
                assert abs(under[stamped][i - 1] - reported[i]) < SAME, (stamped, i)
            for other in {"2", "3", "base"} - {stamped}:
                far = sum(abs(under[other][i - 1] - reported[i]) >= SAME
                          for i in range(start, len(ids)))
                assert far >= n // 2, (stamped, other, far, n)  # another adapter's tokens

        # an adapter the engine refuses (rank 16 > --max-lora-rank 8): rolled back
        job = await _job(admin, {"version": "4", "method": "lora", "lora_path": too_big})
        assert job["status"] == "failed", job
        assert any("greater than max_lora_rank" in e for e in job["errors"]), job["errors"]
        assert (await _call(http, "after-refusal"))["call"]["weight_version"] == "3"
        assert f"{SERVED_NAME}@lora-4" not in await _served(engine)

        # the base weights may not change under loaded adapters
        r = await admin.post("/admin/weight-update", json={
            "version": "base-2", "method": "reload", "weights_path": str(tiny_model_dir)})
        assert r.status_code == 409 and "LoRA adapters are loaded" in r.text, r.text
        # two policies at once: a "verifier" family beside the base's own, interleaved
        # in one trajectory and running side by side; each policy's trained tokens are
        # true under the adapter its calls were stamped with
        job = await _job(admin, {"version": "11", "method": "lora", "model": "verifier",
                                 "lora_path": paths[1], "keep": 1})
        assert job["status"] == "succeeded", job

        async def turn(tid: str, model: str, text: str) -> None:
            r = await http.post("/v1/chat/completions", headers={"x-trajectory-id": tid},
                                json={"model": model, "max_tokens": 16, "ignore_eos": True,
                                      "temperature": 1.0, "messages": [
                                          {"role": "system", "content": f"You are {model}."},
                                          {"role": "user", "content": text}]})
            assert r.status_code == 200, r.text

        await turn("duo", SERVED_NAME, "solve it")
        await asyncio.gather(turn("duo-side", "verifier", "check it"),
                             turn("duo", "verifier", "check the answer"),
                             turn("solo", SERVED_NAME, "solve another"))
        await turn("duo", SERVED_NAME, "solve it again")
        stamps = [(c["model"], c["weight_version"]) for c in
                  (await admin.get("/trajectories/duo")).json()["calls"]]
        assert stamps == [(SERVED_NAME, "3"), ("verifier", "11"), (SERVED_NAME, "3")]
        for model, adapter, calls_of in ((SERVED_NAME, f"{SERVED_NAME}@lora-3", 2),
                                         ("verifier", "verifier@lora-11", 1)):
            samples = (await admin.get(f"/trajectories/duo/samples?model={model}")).json()
            assert sum(sum(s["loss_mask"]) for s in samples["data"]) == 16 * calls_of
            for sample in samples["data"]:
                ids, mask, reported = (sample["token_ids"], sample["loss_mask"],
                                       sample["logprobs"])
                under = await recompute(engine, ids, adapter)
                off = [i for i in range(1, len(ids))
                       if mask[i] and abs(under[i - 1] - reported[i]) >= SAME]
                assert off == [], (model, off)

        print(f"\nLoRA adapter update (job, 1 engine): "
              f"{', '.join(f'{s * 1000:.0f} ms' for s in seconds.values())}; "
              f"full reload of the base checkpoint: {reload_s * 1000:.0f} ms")


async def test_two_policies_train_side_by_side(vllm_python: str, tiny_model_dir: Path,
                                               tmp_path: Path) -> None:
    """``examples/two_policies.py`` as a user runs it, two steps: a solver and a checker
    family on one engine, both in every trajectory. Each step each policy trains on its own
    samples (their tokens only, none of the other's), stamped with the version it served,
    and pushes its next adapter; a sample of one policy carries that policy's reward."""
    import json
    import os
    import sys

    from tests.vllm.conftest import REPO_ROOT

    families = {"solver": SERVED_NAME, "checker": SERVED_NAME}
    async with own_engine_gateway(vllm_python, tiny_model_dir, tmp_path, "two-policies",
                                  lora=True, lora_slots=4, lora_models=families) as url:
        out = tmp_path / "two.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(REPO_ROOT / "examples/two_policies.py"), "--gateway", url,
            "--model-path", str(tiny_model_dir), "--work-dir", str(tmp_path / "run"),
            "--steps", "2", "--groups", "2", "--group-size", "4", "--rank", "8",
            "--json", str(out), cwd=REPO_ROOT, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "ROLLOUT_GATEWAY_ADMIN_TOKEN": "tok"})
        _, err = await asyncio.wait_for(proc.communicate(), 600)
        assert proc.returncode == 0, err.decode()[-4000:]
        run = json.loads(out.read_text())
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin:
            status = (await admin.get("/status")).json()["models"]
            tid = f"{run['run']}-s1-g1-2"  # step 1, group 1, its third trajectory
            own = {p: (await admin.get(f"/trajectories/{tid}/sample", params={"model": p})
                       ).json() for p in ("solver", "checker")}
            models = {c["id"]: c["model"] for c in
                      (await admin.get(f"/trajectories/{tid}")).json()["calls"]}
    for k, step in enumerate(run["steps"]):
        for p in ("solver", "checker"):
            assert step[p]["samples"] == 8 and step[p]["trained_tokens"] > 0
            assert step[p]["stamped"] == [step[p]["served_version"]] == [str(k + 1)]
            assert step[p]["pushed"] == str(k + 2)
    assert {p: status[p]["version"] for p in ("solver", "checker")} == \
        {"solver": "3", "checker": "3"} == run["final_versions"]
    index = 1 * 4 + 2  # the trajectory's place in the step's rewards
    assert [own[p]["reward"] for p in ("solver", "checker")] == \
        [run["steps"][1][p]["rewards"][index] for p in ("solver", "checker")]
    # each policy's sample trains its own turns, all of them, and nothing of the other's
    for policy, sample in own.items():
        trained: dict[str, int] = {}
        for c in sample["calls"]:
            span = sample["loss_mask"][c["completion_start"]:c["completion_end"]]
            trained[models[c["call_id"]]] = trained.get(models[c["call_id"]], 0) + sum(span)
        assert trained.get(policy, 0) > 0
        assert all(n == 0 for m, n in trained.items() if m != policy), trained
