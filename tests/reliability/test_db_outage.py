"""Postgres unreachable for 15 s while calls keep coming.

The outage is real: the gateway reaches Postgres through a TCP relay that is switched
off (connections refused and cut) and on again. Serving must not notice; records wait
in memory, then in the spool file, and all of them are in the database after recovery.
A spool too small for the outage fills memory next; then model calls are refused (503
``recording_unavailable``) rather than answered unrecorded, and /ready, /status and
/metrics say so.
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
    answered = failed = refused = 0
    going: set[int] = set()

    async def worker(i: int) -> None:
        nonlocal answered, failed, refused
        async with httpx.AsyncClient(timeout=10) as http:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"model": "scripted", "stream": n % 2 == 0,
                        "messages": [{"role": "user", "content": f"turn {n}"}]}
                r = await http.post(f"{url}/t/{prefix}{i}/v1/chat/completions", json=body)
                ok = r.status_code == 200 and (not body["stream"] or "[DONE]" in r.text)
                if r.status_code == 503 and "recording_unavailable" in r.text:
                    refused += 1
                    await asyncio.sleep(0.05)
                    continue
                answered += ok
                failed += not ok
                if ok:
                    going.add(i)
                    if len(going) == WORKERS:
                        started.set()

    await asyncio.gather(*(worker(i) for i in range(WORKERS)))
    return answered, failed, refused


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
            answered, failed, refused = await load
            assert failed == refused == 0
            assert answered > 1000  # it really was under load
            assert loop_thread.run(rt.writer.drain(60), timeout=70)
            assert rt.writer.dropped == 0 and rt.writer.db_ok
            assert rt.writer.spool_bytes == 0
        stored = await _count(postgres_url, prefix)
        assert stored == answered
        print(f"\noutage {OUTAGE_S:.0f}s: answered={answered} stored={stored} "
              f"spooled={rt.writer.spooled} max_spool_bytes={max_spooled}")


@pytest.mark.postgres
async def test_a_spool_too_small_for_the_outage_refuses_calls_and_loses_none(
        gateway, scripted, loop_thread, postgres_url, tmp_path):
    """The spool fills (30 kB), then memory (50 + 100 records): from then on model calls
    are refused with 503 ``recording_unavailable``, never answered unrecorded; every
    answered call is stored once the database is back, and calls are taken again."""
    upstream, _ = scripted(Script(tokens=8))
    prefix = "dbfull-"
    settings = _settings("", upstream, tmp_path, 30_000)
    with _relay(loop_thread) as relay:
        settings.database_url = postgres_url.replace("127.0.0.1:5432",
                                                     f"127.0.0.1:{relay.port}")
        settings.traces.queue_size, settings.traces.overflow_size = 50, 100
        with gateway(settings) as (url, rt):
            stop, started = asyncio.Event(), asyncio.Event()
            load = asyncio.create_task(_load(url, prefix, stop, started))
            await asyncio.wait_for(started.wait(), 60)
            loop_thread.run(relay.down())
            deadline = time.monotonic() + 30
            async with httpx.AsyncClient() as http:
                while rt.writer.refusal is None:
                    assert time.monotonic() < deadline, "memory never filled"
                    await asyncio.sleep(0.1)
                status = (await http.get(f"{url}/status")).json()["trace_writer"]
                ready = await http.get(f"{url}/ready")
                await asyncio.sleep(1)  # calls meet the refusal
                loop_thread.run(relay.up())
                await asyncio.sleep(2)  # recovered: calls are taken again
                stop.set()
                answered, failed, refused = await load
                assert loop_thread.run(rt.writer.drain(60), timeout=70)
                metrics = (await http.get(f"{url}/metrics")).text
            assert status["recording"] is False and "trace buffer is full" in status["refusal"]
            assert ready.status_code == 503 and "not recording" in ready.json()["reason"]
            assert failed == 0 and refused > 0
            assert _metric(metrics, "rollout_gateway_trace_recording") == 1.0
            lost = rt.writer.lost["memory_full"]
            assert rt.writer.dropped == lost  # calls in flight as memory filled: counted
            assert _metric(metrics, 'rollout_gateway_trace_lost_total{reason="memory_full"}') \
                == lost
        stored = await _count(postgres_url, prefix)
        assert stored + lost == answered  # every answered call stored, or counted
        assert lost <= 16  # at most the calls that were in flight when memory filled
        print(f"\nspool full: answered={answered} stored={stored} refused={refused} "
              f"lost={lost}")
