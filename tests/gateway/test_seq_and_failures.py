"""Two small contracts of a call's record, through a real gateway and scripted upstreams.

- ``seq`` numbers the *recorded* calls of an attempt 0, 1, 2, ...: a client that leaves
  while its call is still queued (never dispatched, never recorded) takes no number.
- An engine that refuses the client's request (a 4xx such as vLLM's 400 for a
  ``max_tokens`` too large) fails the call, not the backend: ``/status`` does not count it
  among the backend's failures, and its breaker stays closed. A 5xx still counts.
"""

from __future__ import annotations

import asyncio

import httpx

from tests.scripted_upstream import Script

BODY = {"model": "scripted", "messages": [{"role": "user", "content": "x"}]}


def _backend(gw: str) -> dict[str, object]:
    (row,) = httpx.get(f"{gw}/status").json()["backends"]
    return row


async def test_a_client_leaving_while_queued_takes_no_seq(scripted, gateway_at, sqlite_url):
    url, _ = scripted(Script(tokens=6, token_delay_s=0.25))  # a streamed call takes ~1.5 s
    with gateway_at(sqlite_url, [url], dispatch={"cap_per_gpu": 1}) as gw:  # one slot
        path = f"{gw}/t/gaps/v1/chat/completions"
        async with httpx.AsyncClient(timeout=30) as http:
            running = asyncio.create_task(http.post(path, json={**BODY, "stream": True}))
            await asyncio.sleep(0.3)  # it holds the only slot
            try:  # a non-streaming call queues behind it; its client gives up
                await http.post(path, json=BODY, timeout=0.3)
                raise AssertionError("the queued call was answered")
            except httpx.TimeoutException:
                pass
            assert (await running).status_code == 200
            quick = await http.post(path, json={**BODY, "max_tokens": 1})
            assert quick.status_code == 200
            await asyncio.sleep(0.3)  # the writer's flush
            calls = (await http.get(f"{gw}/trajectories/gaps")).json()["calls"]
        assert [(c["attempt"], c["seq"], c["status"]) for c in calls] == [
            (0, 0, "ok"), (0, 1, "ok")]


def test_engine_refusals_are_not_backend_failures(scripted, gateway_at, sqlite_url):
    url, seen = scripted(Script(mode="error400"))
    with gateway_at(sqlite_url, [url], upstream={"breaker_failures": 2}) as gw:
        for _ in range(4):
            r = httpx.post(f"{gw}/v1/chat/completions", json=BODY)
            assert r.status_code == 400, r.text
        assert len(seen.bodies) == 4  # each reached the backend: its breaker never opened
        row = _backend(gw)
        assert row["failures"] == 0 and row["served"] == 4, row


def test_server_errors_still_count_against_the_backend(scripted, gateway_at, sqlite_url):
    url, _ = scripted(Script(mode="error500"))
    with gateway_at(sqlite_url, [url], upstream={"max_attempts": 1}) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=BODY)
        assert r.status_code == 502, r.text
        assert _backend(gw)["failures"] == 1
