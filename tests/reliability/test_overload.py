"""Overload: a burst past ``max_in_flight`` is refused at once with 503 + Retry-After (no
unbounded queue), and bodies past ``max_body_bytes`` get 413 before they are buffered."""

from __future__ import annotations

import asyncio

import httpx

from gateway.config import ServerSettings, Settings, TraceSettings, UpstreamSettings
from tests.scripted_upstream import Script

LIMIT, BURST = 8, 60


def _settings(db: str, upstream: str, **server: object) -> Settings:
    return Settings(database_url=db, backends=[upstream], policy="slime",
                    server=ServerSettings(**server),  # type: ignore[arg-type]
                    upstream=UpstreamSettings(health_interval_s=0.5),
                    traces=TraceSettings(flush_interval_s=0.05))


async def test_burst_past_max_in_flight_gets_503_with_retry_after(scripted, gateway, sqlite_url):
    upstream, seen = scripted(Script(tokens=10, token_delay_s=0.1))  # 1 s streams
    settings = _settings(sqlite_url, upstream, max_in_flight=LIMIT, overload_retry_after_s=3)
    with gateway(settings) as (url, rt):
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=BURST)
                                     ) as http:
            body = {"model": "scripted", "stream": True,
                    "messages": [{"role": "user", "content": "x"}]}
            burst = await asyncio.gather(*(
                http.post(f"{url}/t/burst-{i}/v1/chat/completions", json=body)
                for i in range(BURST)))
            ok = [r for r in burst if r.status_code == 200]
            refused = [r for r in burst if r.status_code == 503]
            assert len(ok) == LIMIT and len(refused) == BURST - LIMIT
            for r in refused:
                assert r.headers["retry-after"] == "3"
                assert r.json()["error"]["code"] == "overloaded"
            assert len(seen.bodies) == LIMIT  # refused calls never reached a backend
            metrics = (await http.get(f"{url}/metrics")).text
            assert f"rollout_gateway_calls_rejected_total {BURST - LIMIT}.0" in metrics
            assert "rollout_gateway_calls_in_flight 0.0" in metrics
            # capacity is back once the burst is over
            r = await http.post(f"{url}/t/after/v1/chat/completions", json=body)
            assert r.status_code == 200
        assert all(b.in_flight == 0 for b in rt.registry)
        refused_ids = {f"burst-{i}" for i in range(BURST)} - {
            r.headers["x-trajectory-id"] for r in ok}
        listed = httpx.get(f"{url}/trajectories", params={"limit": 1000}).json()
        ids = {t["id"] for t in listed["data"]}  # (the list waits for the writer first)
        assert len(ids) == LIMIT + 1
        assert not refused_ids & ids  # nothing recorded for refused calls


def test_huge_bodies_get_413_in_the_right_shape(scripted, gateway, sqlite_url):
    upstream, seen = scripted(Script())
    with gateway(_settings(sqlite_url, upstream, max_body_bytes=64 * 1024)) as (url, _rt):
        big = b'{"model": "scripted", "messages": [{"role": "user", "content": "' + (
            b"x" * 100_000) + b'"}]}'
        r = httpx.post(f"{url}/v1/chat/completions", content=big,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"

        def chunks():  # no Content-Length: the limit applies as the body streams in
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        r = httpx.post(f"{url}/t/chunked/v1/chat/completions", content=chunks(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(f"{url}/trajectories/t1/finish", content=b'{"metadata": {"x": "' + (
            b"y" * 100_000) + b'"}}', headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert "detail" in r.json()
        assert seen.bodies == []
        assert httpx.get(f"{url}/trajectories").json()["data"] == []
