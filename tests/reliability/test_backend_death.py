"""A backend process is SIGKILLed mid-stream.

Affected streams end with an SSE error event within 2 s; calls that had not started are
retried on the surviving backend; the dead one leaves rotation; every counter returns to
zero and the interrupted trajectories carry on elsewhere.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import orjson

from gateway.config import Settings, TraceSettings, UpstreamSettings
from tests.reliability.conftest import MODEL

STREAMS = 8


async def _stream(http: httpx.AsyncClient, url: str, tid: str, started: asyncio.Event,
                  counter: list[int]) -> tuple[str, float]:
    """Returns how the stream ended ('done' or 'error') and when (monotonic)."""
    body = {"model": MODEL, "stream": True, "max_tokens": 2000, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"write a lot ({tid})"}]}
    async with http.stream("POST", f"{url}/t/{tid}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done", time.monotonic()
            payload = orjson.loads(line[6:])
            if "error" in payload:
                assert payload["error"]["type"] == "bad_gateway"
                return "error", time.monotonic()
            chunks += 1
            if chunks == 5:
                counter[0] += 1
                if counter[0] == STREAMS:
                    started.set()
    return "closed-without-error", time.monotonic()


async def test_kill_mid_stream(gateway, sim_children, sqlite_url):
    a, b = sim_children(seed=1), sim_children(seed=2)
    settings = Settings(
        database_url=sqlite_url, backends=[a.url, b.url],
        # a slow health checker: leaving rotation must not wait for it
        upstream=UpstreamSettings(health_interval_s=30, first_byte_timeout_s=10),
        traces=TraceSettings(flush_interval_s=0.05))
    with gateway(settings) as (url, rt):
        backend_a = next(x for x in rt.registry if x.url == a.url)
        async with httpx.AsyncClient(timeout=30) as http:
            started, counter = asyncio.Event(), [0]
            tids = [f"kill-{i}" for i in range(STREAMS)]
            tasks = [asyncio.create_task(_stream(http, url, t, started, counter)) for t in tids]
            await asyncio.wait_for(started.wait(), 20)
            on_a = {t for t in tids if rt.tracker.get(t).backend_id == backend_a.id}
            assert 0 < len(on_a) < STREAMS, "least-loaded should spread the streams"
            killed_at = time.monotonic()
            a.signal(signal.SIGKILL)
            ends = dict(zip(tids, await asyncio.gather(*tasks), strict=True))

            for t in on_a:
                how, when = ends[t]
                assert how == "error", (t, how)
                assert when - killed_at < 2.0, f"{t}: error after {when - killed_at:.2f}s"
            assert all(ends[t][0] == "done" for t in set(tids) - on_a)

            # Calls not yet started: least-loaded prefers the idle dead backend; the
            # refused connection is retried on the survivor before anything is sent back.
            for t in sorted(on_a):
                r = await http.post(f"{url}/t/{t}/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 5,
                    "messages": [{"role": "user", "content": "again"}]})
                assert r.status_code == 200, r.text
            assert not backend_a.routable
            assert (await http.get(f"{url}/health")).json()["backends_routable"] == 1
            assert rt.writer.dropped == 0

            for t in sorted(on_a):
                calls = (await http.get(f"{url}/trajectories/{t}")).json()["calls"]
                assert [c["status"] for c in calls] == ["error", "ok"]
                assert calls[0]["backend_id"] == backend_a.id
                assert calls[1]["backend_id"] != backend_a.id
        assert all(x.in_flight == 0 for x in rt.registry)
        assert all(st.in_flight == 0 and st.queued == 0 for st in rt.tracker)
        metrics = httpx.get(f"{url}/metrics").text
        assert _metric(metrics, "rollout_gateway_calls_in_flight") == 0
        assert _metric(metrics, "rollout_gateway_upstream_retries_total") >= 1


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")
