"""SIGTERM to a real gateway process under load.

Readiness (``GET /health``) turns 503 at once while calls are still accepted for
``shutdown_delay_s``; then the gateway stops accepting, lets calls in flight finish
within ``shutdown_grace_s``, flushes its trace buffer and exits. Every answered call is
in the database; calls cut at the end of the grace period are recorded as cancelled.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
from sqlalchemy import select

from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.models import Call
from tests.reliability.procs import Child
from tests.scripted_upstream import Script
from tests.servers import free_port

STREAMS = 20


def _gateway(backend: str, db: str, tmp_path: Path, *, delay: float, grace: float) -> Child:
    port = free_port()
    env = {"ROLLOUT_GATEWAY_SERVER__SHUTDOWN_DELAY_S": str(delay),
           "ROLLOUT_GATEWAY_SERVER__SHUTDOWN_GRACE_S": str(grace),
           "ROLLOUT_GATEWAY_TRACES__SPOOL_PATH": str(tmp_path / "spool.jsonl"),
           "ROLLOUT_GATEWAY_POLICY": "slime"}
    child = Child(["serve", "--port", str(port), "--backend", backend, "--database-url", db],
                  port, env=env, log=tmp_path / "gateway.log")
    child.wait_ready()
    return child


async def _stream(http: httpx.AsyncClient, url: str, tid: str) -> str:
    body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    try:
        async with http.stream("POST", f"{url}/t/{tid}/v1/chat/completions", json=body) as r:
            text = "".join([chunk async for chunk in r.aiter_text()])
    except httpx.HTTPError as exc:
        return f"cut: {type(exc).__name__}"
    return "done" if "data: [DONE]" in text else "cut"


async def _stored(db: str) -> dict[str, str]:
    engine = make_engine(db)
    try:
        async with make_sessionmaker(engine)() as s:
            rows = (await s.execute(select(Call.trajectory_id, Call.status))).all()
            return {str(row[0]): str(row[1]) for row in rows}
    finally:
        await engine.dispose()


async def test_sigterm_drains_then_exits_with_every_record(scripted, tmp_path):
    upstream, _ = scripted(Script(tokens=20, token_delay_s=0.1))  # 2 s per call
    db = f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"
    gw = _gateway(upstream, db, tmp_path, delay=1.0, grace=10.0)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            calls = [asyncio.create_task(_stream(http, gw.url, f"term-{i}"))
                     for i in range(STREAMS)]
            await asyncio.sleep(0.5)
            signalled = time.monotonic()
            gw.signal(signal.SIGTERM)
            # readiness flips at once, while calls are still taken during the delay
            r = await http.get(f"{gw.url}/health")
            assert r.status_code == 503 and r.json()["status"] == "shutting_down"
            assert time.monotonic() - signalled < 0.5
            late = await http.post(f"{gw.url}/t/term-late/v1/chat/completions", json={
                "model": "scripted", "messages": [{"role": "user", "content": "x"}]})
            assert late.status_code == 200
            outcomes = await asyncio.gather(*calls)
        assert outcomes == ["done"] * STREAMS
        rc = await asyncio.to_thread(gw.proc.wait, 15)
        exited = time.monotonic() - signalled
        assert rc in (0, -signal.SIGTERM), gw.output()
        assert exited < 1.0 + 2.0 + 3.0, exited  # delay + longest call + start-up slack
        # after exit: no new connections
        try:
            httpx.get(f"{gw.url}/health", timeout=1)
            raise AssertionError("still accepting after shutdown")
        except httpx.ConnectError:
            pass
        stored = await _stored(db)
        assert len(stored) == STREAMS + 1  # records stored == calls answered
        assert set(stored.values()) == {"ok"}
        assert "Traceback" not in gw.output()
    finally:
        gw.stop()


async def test_calls_past_the_grace_period_are_cut_and_still_recorded(scripted, tmp_path):
    upstream, seen = scripted(Script(tokens=100, token_delay_s=0.1))  # 10 s per call
    db = f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}"
    gw = _gateway(upstream, db, tmp_path, delay=0.0, grace=1.0)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            calls = [asyncio.create_task(_stream(http, gw.url, f"cut-{i}")) for i in range(5)]
            await asyncio.sleep(0.5)
            signalled = time.monotonic()
            gw.signal(signal.SIGTERM)
            outcomes = await asyncio.gather(*calls)
        assert all(o.startswith("cut") for o in outcomes), outcomes
        await asyncio.to_thread(gw.proc.wait, 15)
        assert time.monotonic() - signalled < 1.0 + 3.0
        stored = await _stored(db)
        assert sorted(stored) == [f"cut-{i}" for i in range(5)]
        assert set(stored.values()) == {"cancelled"}
        assert seen.completed == 0  # the upstream calls were closed, not left running
    finally:
        gw.stop()
