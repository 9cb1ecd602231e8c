"""Postgres unreachable for 15 s while calls keep coming.

The outage is real: the gateway reaches Postgres through a TCP relay that is switched
off (connections refused and cut) and on again. Serving must not notice; records wait
in memory, then in the spool file, and all of them are in the database after recovery.
A spool too small for the outage drops records, and says how many, in /status and
/metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from gateway.config import Settings, TraceSettings, UpstreamSettings
from gateway.store.db import make_engine, make_sessionmaker
from gateway.store.models import Call
from tests.scripted_upstream import Script
from tests.store.relay import TcpRelay

OUTAGE_S = 15.0
WORKERS = 16


async def _count(url: str, prefix: str) -> int:
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as s:
            q = select(func.count()).select_from(Call).where(Call.trajectory_id.like(prefix + "%"))
            return int((await s.execute(q)).scalar_one())
    finally:
        await engine.dispose()


async def _load(url: str, prefix: str, stop: asyncio.Event,
                started: asyncio.Event) -> tuple[int, int]:
    """WORKERS clients calling back to back until ``stop``; (answered, failed).
    ``started`` is set once every client's trajectory has had its first call answered:
    a trajectory's first call needs the store (docs/lifecycle.md, across a restart)."""
    answered = failed = 0
    going: set[int] = set()

    async def worker(i: int) -> None:
        nonlocal answered, failed
        async with httpx.AsyncClient(timeout=10) as http:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"model": "scripted", "stream": n % 2 == 0,
                        "messages": [{"role": "user", "content": f"turn {n}"}]}
                r = await http.post(f"{url}/t/{prefix}{i}/v1/chat/completions", json=body)
                ok = r.status_code == 200 and (not body["stream"] or "[DONE]" in r.text)
                answered += ok
                failed += not ok
                if ok:
                    going.add(i)
                    if len(going) == WORKERS:
                        started.set()

    await asyncio.gather(*(worker(i) for i in range(WORKERS)))
    return answered, failed


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


@contextlib.contextmanager
def _relay(loop_thread):
    relay = TcpRelay(5432)
    loop_thread.run(relay.up())
    try:
        yield relay
    finally:
        with contextlib.suppress(Exception):
            loop_thread.run(relay.down())


def _settings(pg_via_relay: str, upstream: str, tmp_path: Path, spool_max: int) -> Settings:
    return Settings(
        database_url=pg_via_relay, backends=[upstream], policy="slime", auto_migrate=False,
        upstream=UpstreamSettings(health_interval_s=0.5),
        traces=TraceSettings(queue_size=200, batch_size=50, flush_interval_s=0.05,
                             retry_backoff_s=0.1, retry_backoff_max_s=0.5,
                             spool_path=tmp_path / "spool.jsonl", spool_max_bytes=spool_max))


@pytest.mark.postgres
async def test_15s_outage_under_load_loses_nothing(gateway, scripted, loop_thread,
                                                   postgres_url, tmp_path):
    upstream, _ = scripted(Script(tokens=8))
    prefix = "dbout-"
    with _relay(loop_thread) as relay:
        via = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
        with gateway(_settings(via, upstream, tmp_path, 10**9)) as (url, rt):
            stop, started = asyncio.Event(), asyncio.Event()
            load = asyncio.create_task(_load(url, prefix, stop, started))
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.sleep(1)
            loop_thread.run(relay.down())
            outage_start = time.monotonic()
            max_spooled = 0
            async with httpx.AsyncClient() as http:
                while time.monotonic() - outage_start < OUTAGE_S:
                    await asyncio.sleep(0.5)
                    assert (await http.get(f"{url}/health")).status_code == 200
                    tw = (await http.get(f"{url}/status")).json()["trace_writer"]
                    max_spooled = max(max_spooled, tw["spool_bytes"])
            assert not rt.writer.db_ok
            assert max_spooled > 0, "the outage outgrew memory; records should be spooled"
            loop_thread.run(relay.up())
            await asyncio.sleep(2)
            stop.set()
            answered, failed = await load
            assert failed == 0
            assert answered > 1000  # it really was under load
            assert loop_thread.run(rt.writer.drain(60), timeout=70)
            assert rt.writer.dropped == 0 and rt.writer.db_ok
            assert rt.writer.spool_bytes == 0
        stored = await _count(postgres_url, prefix)
        assert stored == answered
        print(f"\noutage {OUTAGE_S:.0f}s: answered={answered} stored={stored} "
              f"spooled={rt.writer.spooled} max_spool_bytes={max_spooled}")


@pytest.mark.postgres
async def test_full_spool_drops_are_counted_and_visible(gateway, scripted, loop_thread,
                                                        postgres_url, tmp_path):
    upstream, _ = scripted(Script(tokens=8))
    prefix = "dbfull-"
    with _relay(loop_thread) as relay:
        via = postgres_url.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
        with gateway(_settings(via, upstream, tmp_path, 30_000)) as (url, rt):
            stop, started = asyncio.Event(), asyncio.Event()
            load = asyncio.create_task(_load(url, prefix, stop, started))
            await asyncio.wait_for(started.wait(), 60)
            loop_thread.run(relay.down())
            await asyncio.sleep(3)
            stop.set()
            answered, failed = await load
            assert failed == 0
            # the last answered calls' records wait in memory until the writer's next
            # retry, then go to the spool or are dropped: read the counters once every
            # answered call's record is accounted for one way or the other
            w, deadline = rt.writer, time.monotonic() + 10
            while w.spooled + w.dropped + w.written < answered:
                assert time.monotonic() < deadline, (answered, w.spooled, w.dropped, w.written)
                await asyncio.sleep(0.1)
            dropped = w.dropped
            async with httpx.AsyncClient() as http:
                status = (await http.get(f"{url}/status")).json()["trace_writer"]
                metrics = (await http.get(f"{url}/metrics")).text
            assert dropped > 0
            assert status["dropped"] == dropped
            assert _metric(metrics, "rollout_gateway_trace_dropped") == dropped
            loop_thread.run(relay.up())
            assert loop_thread.run(rt.writer.drain(60), timeout=70)
        stored = await _count(postgres_url, prefix)
        assert stored + dropped == answered  # every record is either stored or counted
        assert stored > 0
