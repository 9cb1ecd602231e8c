"""The trainer cuts trajectories short (gateway/weights/aborts.py) against simulated engines:
an abort ends the generating call in the engine and refuses later calls until a restart;
the staleness bound aborts what a version change took past it, and nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.store import queries
from tests.gateway.conftest import GatewayFactory
from tests.gateway.slow_engines import ADMIN, HARNESS, KEY, MODEL, N, engine_stats, generating


async def _chat(http: httpx.AsyncClient, tid: str, stream: bool = False,
                max_tokens: int = N) -> httpx.Response | dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                            "messages": [{"role": "user", "content": f"task of {tid}"}]}
    if not stream:
        return await http.post(f"/t/{tid}/v1/chat/completions", json=body)
    finish = None
    async with http.stream("POST", f"/t/{tid}/v1/chat/completions",
                           json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if '"finish_reason":"' in line.replace(" ", ""):
                finish = line
    return {"finish_line": finish}


async def test_abort_ends_the_engine_request_and_refuses_until_restart(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            call = asyncio.create_task(_chat(http, "ab-1"))
            stream = asyncio.create_task(_chat(http, "ab-2", stream=True))
            await generating(slow_engines, 2)
            r = await admin.post("/trajectories/ab-1/abort", json={"reason": "step is full"})
            assert r.status_code == 200, r.text
            assert r.json()["aborted_calls"] == 1 and r.json()["engine_errors"] == []
            assert (await admin.post("/trajectories/ab-2/abort")).status_code == 200
            answer = await asyncio.wait_for(call, 20)
            assert isinstance(answer, httpx.Response) and answer.status_code == 200
            choice = answer.json()["choices"][0]
            assert choice["finish_reason"] == "abort"  # cut short, not run to 240 tokens
            assert answer.json()["usage"]["completion_tokens"] < N
            assert '"abort"' in (await asyncio.wait_for(stream, 20))["finish_line"]
            assert sum(s["running"] for s in await engine_stats(slow_engines)) == 0

            refused = await _chat(http, "ab-1")
            assert isinstance(refused, httpx.Response) and refused.status_code == 409
            err = refused.json()["error"]
            assert err["code"] == "trajectory_aborted" and "step is full" in err["message"]
            assert (await admin.post("/trajectories/ab-1/abort")).status_code == 200  # again
            detail = (await admin.get("/trajectories/ab-1")).json()
            assert detail["metadata"] == {"aborted": "step is full"}
            assert detail["reward"] is None

            r = await admin.post("/trajectories/ab-1/restart")
            assert r.status_code == 200 and r.json()["next_attempt"] == 1
            again = await _chat(http, "ab-1", max_tokens=8)
            assert isinstance(again, httpx.Response) and again.status_code == 200
            assert (await admin.get("/trajectories/ab-1")).json()["attempt"] == 1
            assert (await admin.post("/trajectories/ab-1/restart")).status_code == 409
            assert (await admin.post("/trajectories/nope/abort")).status_code == 404


async def test_aborted_attempts_are_not_finished_trajectories_of_their_group(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            for k in range(3):
                r = await http.post(f"/g/grp/t/grp-{k}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}]})
                assert r.status_code == 200
            await admin.post("/trajectories/grp-0/finish", json={"reward": 1.0})
            await admin.post("/trajectories/grp-1/abort")
            got = (await admin.get("/groups/grp/samples")).json()
            assert got["trajectory_ids"] == ["grp-0"]


async def test_staleness_bound_aborts_only_what_a_version_change_takes_past_it(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY],
                    weight_version="0") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            r = await admin.put("/admin/staleness", json={"max_staleness": 1})
            assert r.json() == {"max_staleness": 1, "aborted": []}
            for tid in ("old", "young"):  # one call each, so each has a first token
                assert (await _chat(http, tid, max_tokens=4)).status_code == 200  # type: ignore[union-attr]
            await admin.put("/admin/weight-version", json={"version": "1"})
            assert (await _chat(http, "young", max_tokens=4)).status_code == 200  # type: ignore[union-attr]
            # "young"'s first token is still from version 0: both are one behind at v1
            fresh = await _chat(http, "fresh", max_tokens=4)
            assert fresh.status_code == 200  # type: ignore[union-attr]
            await admin.put("/admin/weight-version", json={"version": "2"})
            # at v2, "old" and "young" (first token v0) are 2 behind: aborted; "fresh"
            # (first token v1) is 1 behind: kept
            for tid, code in (("old", 409), ("young", 409), ("fresh", 200)):
                r = await _chat(http, tid, max_tokens=4)
                assert r.status_code == code, (tid, r.text)  # type: ignore[union-attr]
            meta = (await admin.get("/trajectories/old")).json()["metadata"]
            assert meta["aborted"].startswith("staleness")
            assert (await admin.get("/admin/staleness")).json() == {"max_staleness": 1,
                                                                     "models": {}}
            assert (await admin.put("/admin/staleness", json={"max_staleness": -1})
                    ).status_code == 422


@pytest.mark.parametrize("store_write_s", [0.0, 0.3])
async def test_staleness_counts_from_a_trajectorys_start_even_while_it_waits(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        store_write_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trajectory whose first call is still queued when the weights move past the bound
    is aborted too: it started on the old weights (issue 44: judged by its first token, it
    escaped, and was then served as if it had started on the new ones).

    With a slow store write (0.3 s): aborting "busy" frees the engine's slot, and a queued
    call of "waiting" must not take it while the aborts' writes are awaited (it did, 1 run
    in 3 on a loaded host, and ran to its end on an engine the abort then missed)."""
    if store_write_s:
        finish = queries.finish_trajectory

        async def slow_finish(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(store_write_s)
            return await finish(*args, **kwargs)

        monkeypatch.setattr(queries, "finish_trajectory", slow_finish)
    with gateway_at(sqlite_url, slow_engines[:1], admin_token="tok", api_keys=[KEY],
                    weight_version="0", dispatch={"cap_per_gpu": 1}) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            await admin.put("/admin/staleness", json={"max_staleness": 1})
            busy = asyncio.create_task(_chat(http, "busy"))  # holds the engine's one slot
            await generating(slow_engines[:1], 1)
            waiting = asyncio.create_task(_chat(http, "waiting"))
            while (await admin.get("/status")).json()["trajectories"]["by_phase"][
                    "queued"] < 1:  # its call has arrived and waits for the slot
                assert not busy.done()
                await asyncio.sleep(0.02)
            for version in ("1", "2"):
                await admin.put("/admin/weight-version", json={"version": version})
            r = await waiting  # ended without a token: refused, or answered as vLLM
            assert isinstance(r, httpx.Response)  # answers an aborted request
            assert r.status_code == 409 or (
                r.json()["choices"][0]["finish_reason"] == "abort"
                and r.json()["usage"]["completion_tokens"] == 0), r.text
            meta = (await admin.get("/trajectories/waiting")).json()["metadata"]
            assert meta["aborted"].startswith(f"staleness: it started on {MODEL} weights 0")
            await admin.post("/trajectories/busy/abort")
            await busy
