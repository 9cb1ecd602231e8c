"""Several policies on one pool: LoRA families of one base model, each its own policy.

A solver and a verifier are two adapter families of one base (``lora_models``); a
trajectory calls both. Each call runs on its family's current adapter (the engines' own
record says which), is recorded under its family's name and stamped with its family's
version; each family has its own version and staleness bound, its own samples (its
branches, its tokens trained) and its own line on ``/status`` and ``/metrics``. The same
with real vLLM: tests/vllm/test_lora_vllm.py.
"""

from __future__ import annotations

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
from tests.servers import LoopThread

SOLVER = [{"role": "system", "content": "You are the solver. Answer with a number."},
          {"role": "user", "content": "What is 17 times 3?"}]


@pytest.fixture(scope="module")
def lora_engines(loop_thread: LoopThread) -> Iterator[list[str]]:
    yield from lora_sim_engines(loop_thread)


async def _update(admin: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    job = await update_job(admin, {"method": "lora", **body})
    assert job["status"] == "succeeded", job
    return job


async def _chat(http: httpx.AsyncClient, tid: str, model: str,
                messages: list[dict[str, Any]], tokens: int = 12) -> httpx.Response:
    return await http.post(f"/t/{tid}/v1/chat/completions", json={
        "model": model, "max_tokens": tokens, "ignore_eos": True, "messages": messages})


async def test_two_families_share_the_engines_with_their_own_versions_and_samples(
        lora_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    adapters = {v: str(write_adapter(tmp_path / f"a{v}", seed=v)) for v in (1, 5, 6)}
    families = {"solver": MODEL, "verifier": MODEL}
    with gateway_at(sqlite_url, lora_engines, admin_token="tok", api_keys=[KEY],
                    lora_models=families) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            # before its first adapter a family runs on its base's weights
            r = await _chat(http, "before", "verifier", SOLVER)
            assert r.status_code == 200, r.text
            await _update(admin, {"version": "1", "model": "solver",
                                  "lora_path": adapters[1]})
            await _update(admin, {"version": "5", "model": "verifier",
                                  "lora_path": adapters[5]})
            status = (await admin.get("/status")).json()
            assert status["weight_version"] == "0"  # the base's own: no update touched it
            assert {m: (v["base"], v["version"], v["adapter"])
                    for m, v in status["models"].items()} == {
                MODEL: (None, "0", None), "solver": (MODEL, "1", "solver@lora-1"),
                "verifier": (MODEL, "5", "verifier@lora-5")}

            # one trajectory calls both: solver, verifier, solver again
            first = (await _chat(http, "t1", "solver", SOLVER)).json()
            answer = first["choices"][0]["message"]["content"]
            check = [{"role": "system", "content": "You are the verifier. Say yes or no."},
                     {"role": "user", "content": f"Is 17 times 3 equal to {answer}?"}]
            verdict = (await _chat(http, "t1", "verifier", check)).json()
            again = [*SOLVER, {"role": "assistant", "content": answer},
                     {"role": "user", "content": "The verifier says: "
                      + verdict["choices"][0]["message"]["content"]}]
            assert (await _chat(http, "t1", "solver", again)).status_code == 200
            assert (await admin.post("/trajectories/t1/finish",
                                     json={"reward": 1.0})).status_code == 200
            models = (await admin.get("/status")).json()["models"]  # every slot given back
            assert {m: (v["calls_running"], v["share"]) for m, v in models.items()} == {
                MODEL: (0, 1.0), "solver": (0, 1.0), "verifier": (0, 1.0)}

            calls = (await admin.get("/trajectories/t1")).json()["calls"]
            stats = await engine_stats(lora_engines)
            assert [(c["model"], c["weight_version"]) for c in calls] == [
                ("solver", "1"), ("verifier", "5"), ("solver", "1")]
            assert [served_model(stats, c["id"]) for c in calls] == [
                "solver@lora-1", "verifier@lora-5", "solver@lora-1"]
            (before,) = (await admin.get("/trajectories/before")).json()["calls"]
            assert (before["model"], served_model(stats, before["id"])) == ("verifier", MODEL)

            # each policy's sample: its conversation, only its own tokens trained
            generated = {c["id"]: c["completion_ids"] for c in calls}
            for model, mine in (("solver", [calls[0], calls[2]]), ("verifier", [calls[1]])):
                sample = (await admin.get(f"/trajectories/t1/sample?model={model}")).json()
                assert sample["main"]
                assert sorted(s["call_id"] for s in sample["calls"]) == sorted(
                    c["id"] for c in mine)
                trained = [t for t, m in zip(sample["token_ids"], sample["loss_mask"],
                                             strict=True) if m]
                assert trained == [t for c in mine for t in generated[c["id"]]]
                last = mine[-1]  # the whole conversation: the fork's shared prefix too
                assert len(sample["token_ids"]) == last["prompt_len"] + len(
                    last["completion_ids"])
                assert {v for v, m in zip(sample["weight_versions"], sample["loss_mask"],
                                          strict=True) if m} == {mine[0]["weight_version"]}
            everything = (await admin.get("/trajectories/t1/samples")).json()["data"]
            assert sum(sum(s["loss_mask"]) for s in everything) == sum(
                len(ids) for ids in generated.values())  # each token trained once
            r = await admin.get("/trajectories/t1/sample?model=critic")
            assert r.status_code == 404 and "no call for model 'critic'" in r.text
            group = (await admin.get("/trajectories/t1/tree?model=verifier")).json()
            assert sum(group["loss_mask"]) == len(generated[calls[1]["id"]])

            # one conversation continued by the other model (an architect and an editor):
            # one branch, each policy's sample of it trains only its own tokens
            one = (await _chat(http, "t2", "solver", SOLVER)).json()
            said = one["choices"][0]["message"]["content"]
            go_on = [*SOLVER, {"role": "assistant", "content": said},
                     {"role": "user", "content": "Check that."}]
            assert (await _chat(http, "t2", "verifier", go_on)).status_code == 200
            assert (await admin.post("/trajectories/t2/finish", json={})).status_code == 200
            calls2 = (await admin.get("/trajectories/t2")).json()["calls"]
            assert [c["branch"] for c in calls2] == [0, 0]
            for model, call in (("solver", calls2[0]), ("verifier", calls2[1])):
                sample = (await admin.get(f"/trajectories/t2/sample?model={model}")).json()
                assert len(sample["calls"]) == 2  # the whole conversation as context
                assert [t for t, m in zip(sample["token_ids"], sample["loss_mask"],
                                          strict=True) if m] == call["completion_ids"]

            # each family's staleness bound, counted in its own versions
            r = await admin.put("/admin/staleness", json={"model": "verifier",
                                                          "max_staleness": 0})
            assert r.status_code == 200, r.text
            assert (await admin.get("/admin/staleness")).json()["models"] == {"verifier": 0}
            assert (await _chat(http, "uses-verifier", "verifier", check)).status_code == 200
            assert (await _chat(http, "solver-only", "solver", SOLVER)).status_code == 200
            job = await _update(admin, {"version": "6", "model": "verifier",
                                        "lora_path": adapters[6]})
            switch = next(p for p in job["phases"] if p["name"] == "switch")
            assert switch["aborted"] == ["uses-verifier"]
            assert switch["model"] == "verifier"
            meta = (await admin.get("/trajectories/uses-verifier")).json()["metadata"]
            assert meta["aborted"].startswith("staleness: it started on verifier weights 5")
            assert (await _chat(http, "solver-only", "solver", SOLVER)).status_code == 200
            metrics = (await admin.get("/metrics")).text
            assert 'rollout_gateway_model_weight_version{model="verifier"} 6.0' in metrics
            assert 'rollout_gateway_model_weight_version{model="solver"} 1.0' in metrics


async def test_aliases_name_families_and_unknown_models_are_refused(
        lora_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        tmp_path: Path) -> None:
    adapter = str(write_adapter(tmp_path / "a", seed=3))
    with gateway_at(sqlite_url, lora_engines, admin_token="tok", api_keys=[KEY],
                    lora_models={"solver": MODEL}, model_aliases={"gpt-5*": "solver"}) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            before = [s["adapter_loads"] for s in await engine_stats(lora_engines)]
            r = await _chat(http, "x", "critic", SOLVER)  # each door answers in its shape
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await http.post("/t/x/v1/messages", json={
                "model": "critic", "max_tokens": 4, "messages": SOLVER[1:]})
            assert r.status_code == 404 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "not_found_error"
            r = await http.post("/t/x/v1/responses", json={"model": "critic", "input": "hi"})
            assert r.status_code == 404 and "critic" in r.json()["error"]["message"]
            for body, status, says in (
                    ({"model": MODEL + "-x", "base_model": "other"}, 409, "is not served"),
                    ({"model": "a@b"}, 422, "pattern"),
                    ({"model": "solver", "base_model": "solver"}, 409, "is not served")):
                r = await admin.post("/admin/weight-update", json={
                    "version": "2", "method": "lora", "lora_path": adapter, **body})
                assert r.status_code == status and says in r.text, (body, r.text)
            # a harness's own model name, through the alias table, names a family
            assert (await _chat(http, "aliased", "gpt-5-codex", SOLVER)).status_code == 200
            (call,) = (await admin.get("/trajectories/aliased")).json()["calls"]
            assert (call["model"], call["requested_model"]) == ("solver", "gpt-5-codex")
            r = await admin.put("/admin/staleness", json={"model": "critic",
                                                          "max_staleness": 1})
            assert r.status_code == 404 and "critic" in r.text
            assert [s["adapter_loads"] for s in await engine_stats(lora_engines)] == before
            # a family's adapter named on its base by default (the one model served)
            r = await admin.post("/admin/weight-update?dry_run=true", json={
                "version": "2", "method": "lora", "lora_path": adapter, "model": "solver"})
            assert r.status_code == 200, r.text
            assert r.json()["adapter"] | {"path": None} == {
                "model": "solver", "base": MODEL, "version": "2", "name": "solver@lora-2",
                "path": None, "rank": 8}


async def test_each_policy_samples_with_its_own_reward(
        lora_engines: list[str], gateway_at: GatewayFactory, db_url: str) -> None:
    """A solver and a verifier in one trajectory, finished with the trajectory's reward and
    the verifier's own: a verifier sample carries the verifier's, a solver sample (no
    reward of its own) and an all-models sample the trajectory's; the group fetch, the
    prefix tree and the viewer's group page the same; a bad ``rewards`` is a 422 that
    changes nothing."""
    families = {"solver": MODEL, "verifier": MODEL}
    with gateway_at(db_url, lora_engines, admin_token="tok", api_keys=[KEY],
                    lora_models=families) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            tid, gid = "two-rewards", "two-rewards-g"
            for model in ("solver", "verifier"):
                r = await http.post(f"/g/{gid}/t/{tid}/v1/chat/completions", json={
                    "model": model, "max_tokens": 8, "ignore_eos": True,
                    "messages": [{"role": "system", "content": f"You are the {model}."},
                                 {"role": "user", "content": "What is 17 times 3?"}]})
                assert r.status_code == 200, r.text
            for bad in ({"": 1.0}, {"verifier": "high"}):
                refused = await admin.post(f"/trajectories/{tid}/finish",
                                           json={"reward": 1.0, "rewards": bad})
                assert refused.status_code == 422, refused.text
            assert (await admin.get(f"/trajectories/{tid}")).json()["finished_at"] is None
            done = await admin.post(f"/trajectories/{tid}/finish", json={
                "reward": 1.0, "rewards": {"verifier": 0.25}})
            assert done.json()["rewards"] == {"verifier": 0.25}

            async def reward(path: str, **params: str) -> Any:
                body = (await admin.get(path, params=params)).json()
                return body["data"][0]["reward"] if "data" in body else body["reward"]

            assert await reward(f"/trajectories/{tid}/sample", model="verifier") == 0.25
            assert await reward(f"/trajectories/{tid}/sample", model="solver") == 1.0
            assert await reward(f"/trajectories/{tid}/sample") == 1.0
            assert await reward(f"/groups/{gid}/samples", model="verifier") == 0.25
            assert await reward(f"/trajectories/{tid}/tree", model="verifier") == 0.25
            page = (await admin.get(f"/groups/{gid}/view",
                                    params={"model": "verifier"})).json()
            assert [m["reward"] for m in page["members"]] == [0.25]
            detail = (await admin.get(f"/trajectories/{tid}")).json()
            assert (detail["reward"], detail["rewards"]) == (1.0, {"verifier": 0.25})
            shown = (await admin.get(f"/trajectories/{tid}/view",
                                     params={"model": "verifier"})).json()
            assert (shown["reward"], shown["rewards"]) == (0.25, {"verifier": 0.25})
            # the id called again is its next attempt: nothing of the last one's rewards
            r = await http.post(f"/g/{gid}/t/{tid}/v1/chat/completions", json={
                "model": "verifier", "max_tokens": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": "again"}]})
            assert r.status_code == 200, r.text
            again = (await admin.get(f"/trajectories/{tid}")).json()
            assert (again["attempt"], again["reward"], again["rewards"]) == (1, None, None)
            assert await reward(f"/trajectories/{tid}/sample", model="verifier") is None
