"""Every token's recorded weight version is the one the engine says made it, in every
pause mode, streamed or not, continued, frozen or started again.

The simulated engine records, as vLLM's output processor does, which weight label made
each token it delivered (``requests_seen[].weight_spans``); :func:`token_truth` rebuilds
each call's tokens from the engine's requests for it and :func:`stamped` reads what the
gateway recorded (``weight_version`` and ``weight_segments``). They must be equal for
every token of every call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway.conftest import GatewayFactory
from tests.gateway.slow_engines import (
    ADMIN,
    HARNESS,
    KEY,
    MODEL,
    TOOLS,
    N,
    engine_stats,
    generating,
)


def token_truth(call: dict[str, Any], seen: list[dict[str, Any]]) -> list[str]:
    """Which weight label made each completion token of ``call``, as the engine recorded
    it: its requests for the call (``chatcmpl-<id>``, ``cmpl-<id>``) in order, each
    placed by its prompt length (a continuation's prompt holds the tokens before it; a
    call sent again starts at 0)."""
    mine = [r for r in seen if r["id"] in (f"chatcmpl-{call['id']}", f"cmpl-{call['id']}")]
    base = mine[0]["prompt_tokens"]
    truth: list[str] = []
    for r in mine:
        offset = r["prompt_tokens"] - base
        del truth[offset:]
        for start, end, version in r["weight_spans"]:
            truth[offset + start:offset + end] = [version] * (end - start)
    return truth


def stamped(call: dict[str, Any]) -> list[str]:
    """The weight version the gateway recorded for each completion token of ``call``."""
    out = [call["weight_version"]] * len(call["completion_ids"])
    for start, end, version in call["weight_segments"] or ():
        out[start:end] = [version] * (end - start)
    return out


async def _call(http: httpx.AsyncClient, tid: str, body: dict[str, Any]) -> int:
    """One call; the number of completion tokens its client saw."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {"model": MODEL, "return_token_ids": True, **body}
    headers = {"x-trajectory-id": tid}
    if not body.get("stream"):
        r = await http.post(path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        return len(r.json()["choices"][0]["token_ids"])
    ids, finishes = 0, 0
    async with http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    ids += len(ch.get("token_ids") or ())
                    finishes += bool(ch.get("finish_reason"))
    assert finishes == 1
    return ids


def _mix(round_: int) -> dict[str, dict[str, Any]]:
    """Chat and completions, whole and streamed, plain, with tools and structured."""
    chat = {"messages": [{"role": "user", "content": f"question {round_}"}],
            "max_tokens": N, "ignore_eos": True}
    text = {"prompt": f"prompt {round_}", "max_tokens": N, "ignore_eos": True}
    kinds = {"chat": chat, "text": text, "tools": {**chat, "tools": TOOLS},
             "json": {**chat, "response_format": {"type": "json_object"}}}
    return {f"r{round_}-{name}-{'s' if stream else 'w'}": {**body, "stream": stream}
            for name, body in kinds.items() for stream in (False, True)}


async def _check_all(http: httpx.AsyncClient, urls: list[str], tids: list[str]
                     ) -> tuple[int, int, int]:
    """(tokens, tokens stamped right, calls whose tokens span versions)."""
    seen = [r for s in await engine_stats(urls) for r in s["requests_seen"]]
    total = right = spanning = 0
    for tid in tids:
        (call,) = (await http.get(f"/trajectories/{tid}", headers=ADMIN)).json()["calls"]
        truth, mine = token_truth(call, seen), stamped(call)
        assert len(truth) == len(mine), (tid, call)
        total += len(mine)
        right += sum(a == b for a, b in zip(truth, mine, strict=True))
        spanning += len(set(truth)) > 1
        assert mine == truth, (tid, call["weight_segments"], call["weight_version"])
    return total, right, spanning


@pytest.mark.parametrize("mode", ["keep", "abort-and-continue", "wait"])
async def test_every_token_is_stamped_with_the_weights_that_made_it(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str,
        mode: str) -> None:
    """Three rounds of the mix under load: one update by pause/resume, one by the job;
    every token's recorded version equals the engine's own record."""
    with gateway_at(sqlite_url, slow_engines, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            await admin.put("/admin/weight-version", json={"version": f"{mode}-0"})
            tids: list[str] = []
            for round_, version in enumerate((f"{mode}-1", f"{mode}-2")):
                calls = {tid: asyncio.create_task(_call(http, f"{mode}-{tid}", body))
                         for tid, body in _mix(round_).items()}
                tids += [f"{mode}-{tid}" for tid in calls]
                await generating(slow_engines, 6)
                if round_ == 0:
                    body = ({"mode": "wait", "engine_mode": "wait"} if mode == "wait"
                            else {"mode": mode})
                    paused = (await admin.post("/admin/pause", json=body)).json()
                    assert paused["ok"], paused
                    await asyncio.sleep(0.2)
                    r = await admin.post("/admin/resume", json={"weight_version": version})
                    assert r.json()["ok"], r.text
                else:
                    r = await admin.post("/admin/weight-update", json={
                        "version": version, "mode": mode, "method": "external"})
                    job = r.json()["job"]
                    await admin.post(f"/admin/weight-update/{job}/done")
                    for _ in range(200):
                        state = (await admin.get(f"/admin/jobs/{job}")).json()
                        if state["status"] not in ("pending", "running"):
                            break
                        await asyncio.sleep(0.05)
                    assert state["status"] == "succeeded", state
                for tid, task in calls.items():
                    assert await task > 0, tid
            total, right, spanning = await _check_all(http, slow_engines, tids)
    print(f"{mode}: {right}/{total} tokens stamped with the weights that made them; "
          f"{spanning} of {len(tids)} calls span versions")
    assert right == total and (spanning > 0 or mode == "wait")


async def test_streams_that_cannot_be_continued_stay_frozen_and_the_rest_is_exact(
        slow_engines: list[str], gateway_at: GatewayFactory, sqlite_url: str) -> None:
    """abort-and-continue with a structured-output stream on the engine: that engine is
    paused with keep, the stream stays frozen (split where the engine stopped), the
    other calls on it are aborted one by one: a whole structured-output call starts
    again (all of it on the new weights), a plain stream is continued token-in."""
    one = slow_engines[:1]
    with gateway_at(sqlite_url, one, admin_token="tok", api_keys=[KEY]) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=ADMIN) as admin, \
                httpx.AsyncClient(base_url=url, timeout=60, headers=HARNESS) as http:
            await admin.put("/admin/weight-version", json={"version": "0"})
            structured = {"messages": [{"role": "user", "content": "find it"}],
                          "max_tokens": N, "ignore_eos": True,
                          "response_format": {"type": "json_object"}}
            calls = {"w": structured, "f": {**structured, "stream": True},
                     "p": {"messages": [{"role": "user", "content": "go on"}],
                           "max_tokens": N, "ignore_eos": True, "stream": True}}
            tasks = [asyncio.create_task(_call(http, tid, body))
                     for tid, body in calls.items()]
            await generating(one, 3)
            r = (await admin.post("/admin/pause", json={"mode": "abort-and-continue"})).json()
            assert [(e["mode"], e["aborted"]) for e in r["engines"]] == [("keep", 2)]
            await asyncio.sleep(0.3)
            await admin.post("/admin/resume", json={"weight_version": "t1"})
            assert await asyncio.gather(*tasks) == [N, N, N]
            records = {tid: (await admin.get(f"/trajectories/{tid}")).json()["calls"][0]
                       for tid in calls}
            total, right, _ = await _check_all(admin, one, list(calls))
    assert right == total == 3 * N
    assert records["w"]["weight_segments"] == [[0, N, "t1"]]  # started again after resume
    (_, k, old), (_, _, new) = records["f"]["weight_segments"]
    assert (old, new) == ("0", "t1") and 0 < k < N
